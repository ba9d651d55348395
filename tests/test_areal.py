"""AReaL 1.0.4's ``RemotevLLMEngine``, unchanged, against tito (tests/trainer_clients/areal_driver.py, in AReaL's own
venv: ``make areal``), and the routes it calls checked one by one for bad input.

Values, not statuses: every generation after an AReaL weight update equals a transformers forward pass on the new
weights (PEFT's merge for LoRA); a rollout cut by ``pause_generation`` is resubmitted by AReaL, and each of its tokens
equals the greedy continuation of the weights its version tag names.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import ServerProcess, free_port, restore_server
from tests.reference import Reference
from tests.venv_build import venv_python

pytestmark = pytest.mark.engine

DRIVERS = Path(__file__).parent / "trainer_clients"
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]  # the driver's
LONG_PROMPT = [7, 7, 3, 9]


def areal_python() -> Path:
    """AReaL's venv (``make areal``; ``make test`` builds it in the background and this waits for that build); the
    test skips, saying why, where it cannot be had."""
    py = venv_python("AReaL", "TITO_AREAL_BUILD", "TITO_AREAL_VENV", "areal")
    if isinstance(py, str):
        pytest.skip(py)
    return py


def run_driver(url: str, plan: dict[str, Any], work: Path) -> dict[str, Any]:
    py = areal_python()
    (work / "plan.json").write_text(json.dumps(plan))
    proc = subprocess.run([str(py), "areal_driver.py", url, str(work / "plan.json")], cwd=DRIVERS, capture_output=True,
                          text=True, timeout=1200, env={**os.environ, "PYTHONWARNINGS": "ignore",
                                                        "TOKENIZERS_PARALLELISM": "false"})
    line = next((x for x in reversed(proc.stdout.splitlines()) if x.startswith("REPORT ")), None)
    assert line is not None, f"the AReaL driver printed no report (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return dict(json.loads(line[len("REPORT "):]))


def ok(report: dict[str, Any], name: str) -> Any:
    entry = report[name]
    assert entry["ok"], f"{name}: {entry['error']}\n{entry.get('trace', '')}"
    return entry["value"]


def model_dir(server: ServerProcess) -> Path:
    return Path(server.cmd[server.cmd.index("--model") + 1])


def perturbed(src: Path, dst: Path, seed: int) -> Path:
    """``src``'s checkpoint with every weight moved (the trainer's next step): a full HF directory."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, dst / f.name)
    gen = torch.Generator().manual_seed(seed)
    sd = load_file(str(src / "model.safetensors"))
    save_file({k: (v + torch.randn(v.shape, generator=gen, dtype=v.dtype) * 0.05 * v.float().std().clamp(min=0.02)
                   ).contiguous() for k, v in sd.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


# ------------------------------------------------------------------------------------------------ full weights


@pytest.fixture(scope="module")
def server(long_tito: ServerProcess) -> Any:
    restore_server(long_tito.url)
    yield long_tito
    restore_server(long_tito.url)


@pytest.fixture(scope="module")
def ckpts(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    base = model_dir(server)
    work = tmp_path_factory.mktemp("areal-ckpts")
    return [perturbed(base, work / "weight_update_v1", 1), perturbed(base, work / "weight_update_v2", 2)]


@pytest.fixture(scope="module")
def full(server: ServerProcess, ckpts: list[Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("areal-full")
    return run_driver(server.url, {"mode": "full", "ckpts": [str(c) for c in ckpts], "fileroot": str(work)}, work)


@pytest.fixture(scope="module")
def refs(server: ServerProcess, ckpts: list[Path]) -> list[Reference]:
    return [Reference(model_dir(server)), *(Reference(c) for c in ckpts)]


def test_generation_calls_equal_transformers(full: dict[str, Any], refs: list[Reference]) -> None:
    base = refs[0]
    ok(full, "initialize")
    got = ok(full, "agenerate")
    toks, lps = base.greedy(PROMPT, 8)
    assert got["tokens"] == toks and got["versions"] == [0] * 8 and got["stop_reason"] == "length"
    assert got["logprobs"] == pytest.approx(lps, abs=1e-3)
    want = base.prompt_logprobs([*PROMPT, 11, 12, 13])[-3:]
    assert ok(full, "compute_logp") == pytest.approx(want, abs=1e-3)
    assert sorted(ok(full, "rollout_batch")) == sorted([base.greedy(PROMPT, 6)[0], base.greedy(LONG_PROMPT, 6)[0]])
    assert ok(full, "submit_wait") == [base.greedy(PROMPT, 6)[0]]
    ok(full, "pause_resume")


def test_pause_cuts_the_rollout_and_every_token_has_its_versions_weights(full: dict[str, Any],
                                                                         refs: list[Reference]) -> None:
    """pause_generation aborts the in-flight rollout (partial tokens back), the disk update lands, AReaL resubmits
    the rest: the tokens tagged 0 are the old weights' greedy continuation, those tagged 1 the new weights' from
    there on."""
    got = ok(full, "pause_generation_update_from_disk")
    tokens, versions = got["tokens"], got["versions"]
    assert len(tokens) == len(versions) == 600 and got["stop_reason"] == "length"
    cut = versions.index(1)
    assert 0 < cut and set(versions[:cut]) == {0} and set(versions[cut:]) == {1}, "the rollout was not cut"
    n0 = min(cut, 200)
    assert tokens[:n0] == refs[0].greedy(LONG_PROMPT, n0)[0]  # EOS does not stop it: AReaL sent ignore_eos
    n1 = min(len(tokens) - cut, 32)
    assert tokens[cut:cut + n1] == refs[1].greedy(LONG_PROMPT + tokens[:cut], n1)[0]


def test_disk_update_equals_a_fresh_engine_on_the_new_weights(full: dict[str, Any], refs: list[Reference]) -> None:
    got = ok(full, "agenerate_after_disk_update")
    assert got["tokens"] == refs[1].greedy(PROMPT, 8)[0] and got["versions"] == [1] * 8


def test_xccl_update_over_gloo_equals_a_fresh_engine(full: dict[str, Any], refs: list[Reference],
                                                     server: ServerProcess) -> None:
    """AReaL's default sync: its own group (init_custom_process_group, gloo), two buckets of announced tensors."""
    ok(full, "init_weights_update_group")
    ok(full, "update_weights_from_distributed")
    got = ok(full, "agenerate_after_xccl")
    toks, lps = refs[2].greedy(PROMPT, 8)
    assert got["tokens"] == toks and got["versions"] == [2] * 8
    assert got["logprobs"] == pytest.approx(lps, abs=1e-3)
    ok(full, "pause_generation")
    ok(full, "continue_generation")
    info = httpx.get(server.url + "/server_info", timeout=30).json()["state"]
    assert not info["weights_inconsistent"]


def test_bad_input_is_refused_before_the_engine(server: ServerProcess, full: dict[str, Any],
                                                tmp_path_factory: pytest.TempPathFactory) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        meta = {"names": ["model.embed_tokens.weight"], "dtypes": ["float32"], "shapes": [[1, 1]],
                "group_name": "nope"}
        r = c.post("/areal_set_update_weight_meta", json=meta)
        assert r.status_code == 400 and "no weight group" in r.text, r.text
        r = c.post("/areal_update_weights_xccl", json={})
        assert r.status_code == 400 and "no tensors announced" in r.text, r.text
        r = c.post("/areal_init_weights_update_group", json={"master_address": "127.0.0.1", "master_port": 1,
                                                             "rank_offset": 1, "world_size": 2, "backend": "nccl",
                                                             "group_name": "g"})
        assert r.status_code == 501, r.text
        r = c.post("/areal_init_weights_update_group", json={"master_address": "127.0.0.1", "master_port": 1,
                                                             "rank_offset": 0, "world_size": 2, "backend": "gloo",
                                                             "group_name": "g"})
        assert r.status_code == 400 and "rank_offset" in r.text, r.text
        r = c.post("/areal_update_weights", json={"model_path": "/etc"})
        assert r.status_code == 403, r.text
        missing = tmp_path_factory.getbasetemp() / "no-such-checkpoint"
        r = c.post("/areal_update_weights", json={"model_path": str(missing)})
        assert r.status_code == 404, r.text
        r = c.post("/init_broadcaster", json={"host": "127.0.0.1", "port": free_port(), "session_id": "s1"})
        assert r.status_code == 501 and "NIXL" in r.text, r.text
        r = c.post("/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}})
        assert r.status_code == 200, r.text


def test_joined_group_checks_announced_tensors_and_loads_only_when_complete(server: ServerProcess, ckpts: list[Path],
                                                                             refs: list[Reference]) -> None:
    """With a real group joined (rank 0 played here, its group built as AReaL builds it), announced tensors are
    checked against the model before anything is received (400); a first bucket is only received (the model still
    answers as before); the last one makes the update and the model answers as the new weights."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from app.engine.worker_areal import custom_group  # AReaL's init_custom_process_group, as the worker builds it

    port = free_port()
    with httpx.Client(base_url=server.url, timeout=120) as c:
        box: dict[str, Any] = {}

        def trainer() -> None:
            box["pg"] = custom_group("gloo", "127.0.0.1", port, 0, 2, "g400", timedelta(seconds=60))

        t = threading.Thread(target=trainer)
        t.start()
        r = c.post("/areal_init_weights_update_group", json={"master_address": "127.0.0.1", "master_port": port,
                                                             "rank_offset": 1, "world_size": 2, "backend": "gloo",
                                                             "group_name": "g400"})
        t.join(60)
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        r = c.post("/areal_set_update_weight_meta", json={"names": ["model.nope.weight"], "dtypes": ["float32"],
                                                          "shapes": [[2, 2]], "group_name": "g400"})
        assert r.status_code == 400 and "model.nope.weight" in r.text, r.text
        r = c.post("/areal_set_update_weight_meta", json={"names": ["model.norm.weight"], "dtypes": ["float32"],
                                                          "shapes": [[3]], "group_name": "g400"})
        assert r.status_code == 400 and "shape mismatch" in r.text, r.text
        r = c.post("/areal_set_update_weight_meta", json={"names": ["model.norm.weight"], "dtypes": ["complex64"],
                                                          "shapes": [[3]], "group_name": "g400"})
        assert r.status_code == 400 and "dtype" in r.text, r.text
        before = generate(c)
        tensors = sorted(load_file(str(ckpts[0] / "model.safetensors")).items())
        half = len(tensors) // 2
        for part, last in ((tensors[:half], False), (tensors[half:], True)):
            r = c.post("/areal_set_update_weight_meta", json={"names": [n for n, _ in part],
                                                              "dtypes": [str(t.dtype)[6:] for _, t in part],
                                                              "shapes": [list(t.shape) for _, t in part],
                                                              "group_name": "g400"})
            assert r.status_code == 200, r.text
            answer: dict[str, Any] = {}
            call = threading.Thread(target=lambda a=answer: a.update(r=c.post("/areal_update_weights_xccl", json={})))
            call.start()
            for _, tensor in part:
                opts = dist.BroadcastOptions()
                opts.rootRank, opts.rootTensor = 0, 0
                box["pg"].broadcast([tensor.contiguous()], opts).wait(timedelta(seconds=60))
            call.join(120)
            r = answer["r"]
            assert r.status_code == 200 and r.json()["noop"] is (not last), r.text
            if not last:
                assert generate(c) == before  # received, not loaded
        assert generate(c) == refs[1].greedy(PROMPT, 8)[0]
        dist.destroy_process_group(box["pg"])


def generate(c: httpx.Client) -> list[int]:
    r = c.post("/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 8,
                                                                                         "temperature": 0}})
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["token_ids"])


# ------------------------------------------------------------------------------------------------ LoRA


@pytest.fixture(scope="module")
def lora_server(lora_tito: ServerProcess) -> Any:
    restore_server(lora_tito.url)
    yield lora_tito
    with httpx.Client(base_url=lora_tito.url, timeout=60) as c:
        for entry in c.get("/lora_adapters").json()["data"]:
            c.post("/v1/unload_lora_adapter", json={"lora_name": entry["lora_name"]})
    restore_server(lora_tito.url)


@pytest.fixture(scope="module")
def lora_run(lora_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Version 0 from disk (/v1/load_lora_adapter), versions 1 and 2 over AReaL's LoRA broadcast; the transformers
    references with each version merged in."""
    from tests.test_lora import make_weights, merged_reference, write_adapter

    base_dir = model_dir(lora_server)
    base = load_file(str(base_dir / "model.safetensors"))
    work = tmp_path_factory.mktemp("areal-lora")
    weights = [make_weights(base, 100 + v) for v in range(3)]
    dirs = [write_adapter(work / f"adapter_v{v}", w) for v, w in enumerate(weights)]
    refs = [merged_reference(base_dir, base, w, work / f"merged_v{v}") for v, w in enumerate(weights)]
    report = run_driver(lora_server.url, {"mode": "lora", "lora_name": "policy", "ckpts": [str(d) for d in dirs],
                                          "fileroot": str(work)}, work)
    return {"report": report, "refs": refs}


def test_lora_versions_from_disk_and_broadcast_equal_peft_merged(lora_run: dict[str, Any],
                                                                 lora_server: ServerProcess) -> None:
    report, refs = lora_run["report"], lora_run["refs"]
    ok(report, "initialize")
    ok(report, "update_weights_from_disk_lora")
    ok(report, "init_weights_update_group")
    ok(report, "update_weights_from_distributed_lora")
    ok(report, "update_weights_from_distributed_lora_2")
    for v in range(3):
        got = ok(report, f"agenerate_lora_v{v}")
        toks, lps = refs[v].greedy(PROMPT, 8)
        assert got["tokens"] == toks, f"version {v}"
        assert got["logprobs"] == pytest.approx(lps, abs=1e-3)
        assert got["versions"] == [v] * 8
    assert refs[1].greedy(PROMPT, 8)[0] != refs[2].greedy(PROMPT, 8)[0] or \
        refs[0].greedy(PROMPT, 8)[0] != refs[1].greedy(PROMPT, 8)[0]
    # --lora-keep-versions 2 (the default): v0 was unloaded when v2 loaded.
    names = {e["lora_name"] for e in httpx.get(lora_server.url + "/lora_adapters", timeout=30).json()["data"]}
    assert names == {"policy-v1", "policy-v2"}
    r = httpx.post(lora_server.url + "/v1/completions", json={"model": "policy-v0", "prompt": PROMPT, "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 404, r.text
