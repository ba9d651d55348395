"""An independent reference: a transformers forward pass on the same weights (fp32)."""

from __future__ import annotations

from pathlib import Path

import torch


class Reference:
    def __init__(self, model_dir: Path | str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
        self.model.eval()

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """The LM head's logits at every position of ``ids`` (row i predicts token i+1), in fp32."""
        return self.model(torch.tensor([ids])).logits[0].float()

    @torch.no_grad()
    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """log-softmax over the vocabulary at every position of ``ids`` (row i predicts token i+1)."""
        out = self.model(torch.tensor([ids]))
        return torch.log_softmax(out.logits[0].float(), dim=-1)

    def greedy(self, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
        """Greedy continuation of ``prompt`` for ``n`` tokens, with each chosen token's logprob."""
        ids = list(prompt)
        toks: list[int] = []
        lps: list[float] = []
        for _ in range(n):
            row = self.logprobs(ids)[-1]
            t = int(torch.argmax(row))
            toks.append(t)
            lps.append(float(row[t]))
            ids.append(t)
        return toks, lps

    def prompt_logprobs(self, prompt: list[int]) -> list[float]:
        """logprob of each prompt token given the ones before it (position 0 has none)."""
        lp = self.logprobs(prompt)
        return [float(lp[i - 1, prompt[i]]) for i in range(1, len(prompt))]


class PeftReference(Reference):
    """transformers + PEFT: a LoRA adapter directory as a trainer would load it (``None``: the base model alone)."""

    def __init__(self, model_dir: Path | str, adapter: Path | str | None) -> None:
        super().__init__(model_dir)
        if adapter is not None:
            from peft import PeftModel

            self.model = PeftModel.from_pretrained(self.model, str(adapter)).eval()
