"""Run as a script (a process of its own: it initializes vLLM's one-rank distributed state): a tied embedding and LM
head built from vLLM's own layers on CPU, loaded, processed, then reloaded in place through vLLM's layerwise reload,
first with vLLM's code as it is, then with tito's fix 8 (app/engine/vllm_patches_weights.py). Prints one JSON line,
for each: how far the head's logits are from the new and from the old weights, whether the head shares the
embedding's kernel, and whether the old kernel (its packed matrix) is gone after the reload."""

from __future__ import annotations

import json
import weakref

import torch
from torch import nn


def run(patched: bool) -> dict[str, object]:
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    from vllm.model_executor.model_loader.reload import layerwise

    from app.engine.vllm_patches_weights import patch_cpu_tied_head, tie_heads

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = VocabParallelEmbedding(512, 64, params_dtype=torch.bfloat16)
            self.lm_head = ParallelLMHead(512, 64, params_dtype=torch.bfloat16).tie_weights(self.embed_tokens)

        def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
            for _, t in weights:
                self.embed_tokens.weight.weight_loader(self.embed_tokens.weight, t)
            return {"embed_tokens.weight"}

    if patched:
        assert patch_cpu_tied_head()
    model = Tied()
    layerwise.record_metadata_for_reloading(model)
    gen = torch.Generator().manual_seed(0)
    old, new = (torch.randn(512, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    model.load_weights([("embed_tokens.weight", old)])
    for module in model.modules():  # what the loader's processing does for these layers
        if getattr(module, "quant_method", None) is not None:
            module.quant_method.process_weights_after_loading(module)
    if patched:
        tie_heads(model)  # what the fix adds after the loader's processing
    shared_at_load = model.lm_head.cpu_linear is model.embed_tokens.cpu_linear
    old_kernel = weakref.ref(model.lm_head.cpu_linear)
    layerwise.initialize_layerwise_reload(model)
    model.load_weights([("embed_tokens.weight", new)])
    layerwise.finalize_layerwise_reload(model, None)
    logits = model.lm_head.quant_method.apply(model.lm_head, x).float()
    return {"from_new": (logits - x.float() @ new.float().t()).abs().max().item(),
            "from_old": (logits - x.float() @ old.float().t()).abs().max().item(),
            "shared_at_load": shared_at_load,
            "shared": model.lm_head.cpu_linear is model.embed_tokens.cpu_linear,
            "old_kernel_freed": old_kernel() is None,
            "embedding_new": torch.equal(model.embed_tokens.weight, new)}


def main() -> dict[str, object]:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    from tests.helpers import free_port

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        initialize_model_parallel(1, 1)
        return {"unpatched": run(False), "patched": run(True)}


if __name__ == "__main__":
    print(json.dumps(main()))
