"""Router replay's wire: ``routed_experts`` as Prime-RL's server sends it (``{"data", "shape", "start", "dtype"}``),
read by Prime-RL's own client code; vLLM's base64 ``.npy`` with ``--routed-experts-format npy``.

Here the engine's side is vLLM's own capture format (``RoutedExpertsCapturer``'s snapshots: uint8 ``[positions,
moe_layers, top_k]`` up to 256 experts, uint16 past), handed to the real app by the fake engine. The encoding is
compared byte for byte with Prime-RL's server encoder (``prime_rl.inference.vllm.routed_experts``, from the source
snapshot; ``pybase64``, its faster base64, stands in as the standard library's when not installed: the same bytes),
the answer is parsed by ``renderers``' own ``parse_generate_response`` (its fast path splices ``data`` out before
the JSON), and decoded as verifiers' ``_attribute_routed_experts`` decodes it (``verifiers`` itself is not installed
here: its dependency tree is a runtime's; the rule is its three lines, quoted below). The real engine's capture,
on CPU with a tiny MoE, against transformers' router: tests/test_router_replay.py.
"""

from __future__ import annotations

import base64
import binascii
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.core.settings import Settings
from app.engine.routed_experts import routed_experts_compact, routed_experts_refusal
from tests.fake_engine import FakeEngine
from tests.prime_rl_src import use_prime_rl
from tests.test_fast_http import serve

GEN = "/inference/v1/generate"


def vllm_capture(positions: int, layers: int, top_k: int, experts: int, seed: int = 0) -> np.ndarray:
    """What vLLM's capturer hands out: the narrowest dtype for ``experts`` ids (its ``output_dtype``)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, experts, size=(positions, layers, top_k))
    return ids.astype(np.uint8 if experts <= 256 else np.uint16)


def prime_rl_encoder() -> Any:
    use_prime_rl()
    if "pybase64" not in sys.modules:
        try:
            import pybase64  # noqa: F401
        except ImportError:
            sys.modules["pybase64"] = base64
    from prime_rl.inference.vllm.routed_experts import serialize_routed_experts

    return serialize_routed_experts


def verifiers_decode(payload: dict[str, Any]) -> np.ndarray:
    # verifiers/v1/graph.py (0.4.0), _attribute_routed_experts:
    raw = binascii.a2b_base64(payload["data"])
    return np.frombuffer(raw, dtype=np.dtype(payload.get("dtype", "uint8"))).reshape(payload["shape"])


@pytest.mark.parametrize(("experts", "dtype"), [(128, "uint8"), (256, "uint8"), (512, "uint16")])
@pytest.mark.parametrize("start", [0, 37])
def test_the_encoding_is_prime_rl_servers(experts: int, dtype: str, start: int) -> None:
    arr = vllm_capture(23, 4, 8, experts)
    ours = routed_experts_compact(arr, start)
    assert ours == prime_rl_encoder()(arr, start)
    assert ours is not None and ours["dtype"] == dtype and ours["start"] == start and ours["shape"] == [23, 4, 8]
    # vLLM's device buffer is int32: the same ids give the same answer.
    assert routed_experts_compact(arr.astype(np.int32), start) == ours


def test_bad_capture_is_refused() -> None:
    with pytest.raises(ValueError):
        routed_experts_compact(np.zeros((2, 3), dtype=np.uint8))
    with pytest.raises(ValueError):
        routed_experts_compact(np.full((1, 1, 1), 70000, dtype=np.int32))


@pytest.mark.parametrize("experts", [64, 512])
async def test_prime_rl_client_reads_the_answer(experts: int) -> None:
    from renderers.client import parse_generate_response

    arr = vllm_capture(9, 3, 2, experts, seed=experts)
    async with serve(FakeEngine(routed_experts=arr)) as (c, _):
        body = {"token_ids": [1, 2, 3, 4, 5], "sampling_params": {"max_tokens": 4, "routed_experts_prompt_start": 4}}
        r = await c.post(GEN, json=body)
        assert r.status_code == 200, r.text
        assert b'"routed_experts":{"data":"' in r.content  # the client's fast path (data first, compact JSON)
        payload = parse_generate_response(r.content)["choices"][0]["routed_experts"]
        assert isinstance(payload["data"], memoryview)  # spliced out, as the client does for megabytes of routing
        assert payload["start"] == 4 and payload["dtype"] == ("uint8" if experts <= 256 else "uint16")
        np.testing.assert_array_equal(verifiers_decode(payload), arr)


async def test_vllm_form_on_request_of_the_operator() -> None:
    from vllm.utils.serial_utils import numpy2base64

    arr = vllm_capture(5, 2, 2, 32)
    async with serve(FakeEngine(routed_experts=arr), routed_experts_format="npy") as (c, _):
        r = await c.post(GEN, json={"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["routed_experts"] == numpy2base64(arr)


@pytest.mark.parametrize(("flags", "reason"), [
    ({}, ""),
    ({"enable_return_routed_experts": False, "enforce_eager": False}, ""),
    ({"enforce_eager": False}, "needs --enforce-eager"),
    ({"engine_start": "spawn"}, "needs the engine's processes forked"),
    ({"data_parallel_size": 2}, "--data-parallel-size 1"),
])
def test_where_the_cpu_cannot_serve_them(flags: dict[str, Any], reason: str, monkeypatch: pytest.MonkeyPatch) \
        -> None:
    """On CPU the flag takes tito's fix to vLLM's CPU runner (tests/test_router_replay.py serves it); where the fix
    does not reach or was not run, the start is refused with the reason (tito serve's exit 2, tests/test_cli.py).
    (This test process did not start with the LD_PRELOAD ``tito serve`` gives itself: fork is taken as possible.)"""
    from app.engine import process_start

    real = process_start.fork_refusal
    monkeypatch.setattr(process_start, "fork_refusal", lambda how: None if how == "fork" else real(how))
    settings = Settings(**{"enable_return_routed_experts": True, **flags})
    got = routed_experts_refusal(settings)
    assert (reason in got and got.startswith("--enable-return-routed-experts")) if reason else got == ""


@pytest.mark.parametrize(("flags", "eager"), [
    ({}, False),  # vLLM's default: torch.compile
    ({"enforce_eager": True}, True),
    ({"enable_return_routed_experts": True}, True),  # the CPU capture is eager only: implied
    ({"enable_return_routed_experts": True, "enforce_eager": False}, False),  # given: refused at start (above)
])
def test_engine_mode_on_cpu(flags: dict[str, Any], eager: bool, tmp_path: Path) -> None:
    """tito's CPU engine arguments leave vLLM's defaults (torch.compile, chunked prefill) but where a flag needs
    eager; the start-up log's compile hint follows the same rule. (A local directory: the suite runs offline,
    where vLLM cannot look a name up.)"""
    from app.engine.engine_setup import compiles, cpu_safe_defaults, engine_args, on_cpu

    if not on_cpu():
        pytest.skip("tito's CPU defaults")
    settings = Settings(model=str(tmp_path), **flags)
    assert cpu_safe_defaults(settings)["enforce_eager"] is eager
    assert compiles(settings) is not eager
    if not flags.get("enable_return_routed_experts"):
        assert engine_args(settings).enable_chunked_prefill is None  # vLLM decides: on for these models
