"""Fast tests (no engine) of tito's fixes to vLLM (app/engine/vllm_patches.py), on vLLM's own code: the CPU
platform's LoRA ops and punica wrapper, and the V1 model runner's prompt-logprobs loop (chunked prefill included,
which tito's CPU engine never schedules). Each test also runs vLLM's unpatched code (``__wrapped__``) and shows the
bug, so it fails if the fix is gone. The real-engine evidence is tests/test_lora_exactness.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from app.engine import vllm_patches


@pytest.fixture(scope="module", autouse=True)
def patched() -> None:
    assert vllm_patches.install(), "the fixes were not applied (vLLM version, or TITO_VLLM_PATCHES=0)"


def test_cpu_ops_leave_no_adapter_rows_alone() -> None:
    """Row 1 has no adapter (-1): shrink and expand leave it as it was; the other rows get their own slot."""
    from vllm.lora.ops.torch_ops import lora_ops

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(2, 1, 4, 8, generator=gen)  # (slots, 1, rank, hidden)
    b = torch.randn(2, 1, 6, 4, generator=gen)  # (slots, 1, out, rank)
    x = torch.randn(3, 8, generator=gen)
    idx = torch.tensor([0, -1, 1])
    buf = torch.zeros(3, 4)
    lora_ops.bgmv_shrink(x, a, buf, idx, 1.0)
    assert torch.equal(buf[1], torch.zeros(4))
    assert torch.allclose(buf[0], a[0, 0] @ x[0]) and torch.allclose(buf[2], a[1, 0] @ x[2])
    y = torch.ones(3, 6)
    lora_ops.bgmv_expand(torch.randn(3, 4, generator=gen), b, y, idx, add_inputs=True)
    assert torch.equal(y[1], torch.ones(6)) and not torch.equal(y[0], torch.ones(6))
    lora_ops.bgmv_expand_slice(torch.randn(3, 4, generator=gen), b, y, idx, 0, 6, add_inputs=False)
    assert torch.equal(y[1], torch.ones(6))
    # vLLM's own op: the -1 row gets the last slot's adapter.
    unfixed = torch.zeros(3, 4)
    lora_ops.bgmv_shrink.__wrapped__(x, a, unfixed, idx, 1.0)  # type: ignore[attr-defined]
    assert torch.allclose(unfixed[1], a[1, 0] @ x[1])


def test_cpu_punica_prefill_keeps_base_rows_base() -> None:
    """The CPU punica wrapper's prefill path (sgmv ops over runs of equal indices), as a LoRA linear layer calls it,
    with both slots holding an adapter: the base request's rows are left as the base layer computed them."""
    from vllm.lora.layers.utils import LoRAMapping
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    punica = PunicaWrapperCPU(16, 4, "cpu")
    # LoRA ids per token: adapter 1 (slot 0) x2, base x3, adapter 2 (slot 1) x1.
    punica.update_metadata(LoRAMapping((1, 1, 0, 0, 0, 2), (1, 0, 2), is_prefill=True), [1, 2], 2, 512)
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(2, 1, 4, 8, generator=gen)
    b = torch.randn(2, 1, 6, 4, generator=gen)
    x = torch.randn(6, 8, generator=gen)
    y = torch.zeros(6, 6)
    punica.add_lora_linear(y, x, (a,), (b,), 1.0, (6,))
    assert torch.equal(y[2:5], torch.zeros(3, 6))
    assert torch.allclose(y[0], b[0, 0] @ (a[0, 0] @ x[0]), atol=1e-5)
    assert torch.allclose(y[5], b[1, 0] @ (a[1, 0] @ x[5]), atol=1e-5)


class _Model:
    """Stands for the LoRA model: records the LM head's mapping (``sampler_indices``) at every logits call."""

    def __init__(self, punica: Any, w: torch.Tensor) -> None:
        self.punica, self.w, self.seen = punica, w, []  # type: list[list[int]]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.punica.sampler_indices.tolist())
        return hidden @ self.w


def _runner(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, _Model, torch.Tensor, dict[str, int]]:
    """One step of three requests: A (adapter 1, slot 0) in the middle of a chunked prefill of its 10-token prompt,
    B (base) prefilling its whole 3-token prompt, C (adapter 2, slot 1) decoding; A and B ask for prompt logprobs."""
    from vllm.lora.layers.utils import LoRAMapping
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU
    from vllm.v1.sample.sampler import Sampler

    punica = PunicaWrapperCPU(32, 4, "cpu")
    punica.update_metadata(LoRAMapping((1, 1, 1, 1, 0, 0, 0, 2), (1, 0, 2), is_prefill=True), [1, 2], 2, 512)
    model = _Model(punica, torch.randn(8, 16, generator=torch.Generator().manual_seed(2)))
    monkeypatch.setattr(vllm_patches, "_lm_head_punica", lambda m: punica)
    requests = {"A": SimpleNamespace(prompt_token_ids=list(range(1, 11)), in_progress_prompt_logprobs_cpu=None,
                                     num_computed_tokens=4),
                "B": SimpleNamespace(prompt_token_ids=[7, 8, 9], in_progress_prompt_logprobs_cpu=None,
                                     num_computed_tokens=0)}
    runner = SimpleNamespace(
        num_prompt_logprobs={"A": 1, "B": 1}, requests=requests, device="cpu", model=model, lora_config=object(),
        get_model=lambda: model, input_batch=SimpleNamespace(req_id_to_index={"A": 0, "B": 1, "C": 2}),
        query_start_loc=SimpleNamespace(np=np.array([0, 4, 7, 8])), model_config=SimpleNamespace(
            logprobs_mode="raw_logprobs"), sampler=Sampler(), _sync_device=lambda: None)
    hidden = torch.randn(8, 8, generator=torch.Generator().manual_seed(3))
    return runner, model, hidden, {"A": 4, "B": 3, "C": 1}


def test_prompt_logits_use_each_rows_own_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each request's prompt rows through its own adapter (chunk rows of A: slot 0; B's rows: none), the step's
    sampler mapping put back afterwards, and B's finished prompt logprobs returned."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner, model, hidden, scheduled = _runner(monkeypatch)
    out = GPUModelRunner._get_prompt_logprobs_dict(runner, hidden, scheduled)  # type: ignore[arg-type]
    assert model.seen == [[0, 0, 0, 0], [-1, -1]]
    assert model.punica.sampler_indices.tolist() == [0, -1, 1]
    assert set(out) == {"B"} and "compute_logits" not in vars(model)
    want = torch.log_softmax(hidden[4:6] @ model.w, dim=-1)[torch.arange(2), torch.tensor([8, 9])]
    assert torch.allclose(out["B"].logprobs[:, 0], want)


def test_unpatched_prompt_logits_use_the_sampler_mapping(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.32 as shipped (vLLM issues 16668, 17766): every request's prompt rows see the per-request sampler
    mapping, three indices for four (then two) rows: the CPU ops' shapes clash, GPU kernels misapply adapters."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner, model, hidden, scheduled = _runner(monkeypatch)
    GPUModelRunner._get_prompt_logprobs_dict.__wrapped__(runner, hidden, scheduled)  # type: ignore[attr-defined]
    assert model.seen == [[0, -1, 1], [0, -1, 1]]


def test_prompt_rows_that_are_not_a_slice_fail_loudly() -> None:
    hidden = torch.zeros(6, 4)
    assert vllm_patches.row_of(hidden[2:5], hidden) == 2
    with pytest.raises(RuntimeError, match="not a slice"):
        vllm_patches.row_of(hidden[2:5].clone(), hidden)


def test_cpu_queue_reader_sleeps_soon_after_a_message() -> None:
    """vLLM's shared-memory queue, as the worker reads the scheduler's steps from it: after a message, a reader that
    waits for the next one sleeps on its notify socket within the CPU window instead of spinning for a second (vLLM's
    own constructor still sets the one-second window)."""
    import threading
    import time

    from vllm.distributed.device_communicators import shm_broadcast as shm

    writer = shm.MessageQueue(1, 1)
    readers: list[Any] = []
    joined = threading.Thread(target=lambda: readers.append(shm.MessageQueue.create_from_handle(
        writer.export_handle(), 0)) or readers[0].wait_until_ready())
    joined.start()
    writer.wait_until_ready()
    joined.join(30)
    reader = readers[0]
    assert reader._spin_condition.busy_loop_s == vllm_patches.spin_window_s() < 1
    poller = reader._spin_condition.poller
    sleeps: list[float] = []
    poll = poller.poll
    poller.poll = lambda timeout=None: sleeps.append(time.monotonic()) or poll(timeout)
    writer.enqueue("step")
    assert reader.dequeue(timeout=10) == "step"
    read = time.monotonic()
    with pytest.raises(TimeoutError):
        reader.dequeue(timeout=0.5)
    # Asleep well within the half second (the window is 10 ms; vLLM's spins past the whole wait).
    assert sleeps and sleeps[0] - read < 0.25, sleeps
    writer.enqueue("next")  # and a sleeping reader is woken by the next message
    assert reader.dequeue(timeout=10) == "next"

    import zmq

    unpatched = shm.SpinCondition.__new__(shm.SpinCondition)
    shm.SpinCondition.__init__.__wrapped__(unpatched, True, zmq.Context.instance(),  # type: ignore[attr-defined]
                                           "inproc://tito-unpatched-spin")
    assert unpatched.busy_loop_s == 1



_AMX_PROBE = """
import ctypes, json
from app.engine import vllm_patches

libc = ctypes.CDLL(None, use_errno=True)

def tile_permitted():  # arch_prctl(ARCH_GET_XCOMP_PERM): bit 18 is XTILEDATA, AMX's tile state
    bits = ctypes.c_uint64(0)
    assert libc.syscall(158, 0x1022, ctypes.byref(bits)) == 0, ctypes.get_errno()
    return bool(bits.value >> 18 & 1)

before = tile_permitted()
asked = vllm_patches.request_amx_permission()
print(json.dumps({"before": before, "asked": asked, "after": tile_permitted()}))
"""


def test_a_worker_may_run_vllms_amx_attention_kernel() -> None:
    """vLLM picks its AMX attention kernel for bfloat16 on an AMX CPU, yet a fresh process (a spawned worker) has no
    AMX permission from Linux until something asks (vLLM does not: the worker dies of SIGILL at its first forward);
    tito's fix asks."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("no AMX on this CPU")
    assert _get_attn_isa(torch.bfloat16, 128) == "amx"
    assert "cpu-amx-permission" in vllm_patches.install()
    out = subprocess.run([sys.executable, "-c", _AMX_PROBE], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"before": False, "asked": True, "after": True}


def test_a_tied_head_takes_the_embeddings_new_kernel_after_a_reload() -> None:
    """vLLM's own tied embedding and LM head on CPU, reloaded in place through vLLM's layerwise reload (in a process
    of its own: vLLM's distributed state). With vLLM as it is, the head's logits still come from the old weights
    (its GEMM handle was packed from them); with the fix they come from the new ones, and the head shares the
    embedding's kernel from the first load on (one packed copy of the matrix, not two)."""
    import json
    import subprocess
    import sys

    from tests.helpers import ROOT, engine_env

    out = subprocess.run([sys.executable, "-m", "tests.tied_head_check"], cwd=ROOT, env=engine_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    fixed, unfixed = res["patched"], res["unpatched"]
    # bf16 logits of 64-term dot products: the old weights are ~40 away, rounding well under 1.
    assert fixed["from_new"] < 0.5 < fixed["from_old"] and fixed["embedding_new"], fixed
    assert fixed["shared_at_load"] and fixed["shared"] and fixed["old_kernel_freed"], fixed
    assert unfixed["from_old"] < 0.5 < unfixed["from_new"] and unfixed["embedding_new"], unfixed
    assert not unfixed["shared_at_load"] and not unfixed["old_kernel_freed"], unfixed
