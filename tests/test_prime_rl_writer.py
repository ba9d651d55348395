"""Weights as Prime-RL's trainer writes them, applied through Prime-RL's own admin client, on a tied model (the head is
the embedding, as the seed's Qwen3-0.6B) and an untied one.

Each step is written by Prime-RL's filesystem writer, unchanged (``gather_weights_parallel`` →
``convert_state_dict_to_hf`` → ``save_state_dict_parallel``, what ``FileSystemWeightBroadcast.broadcast_weights``
runs), from a transformers model sharded with FSDP2 over a one-rank gloo group, as its trainer shards it (so the
DTensors go out in bfloat16, as on GPUs). For a tied model the state dict names the shared tensor twice: the step
holds ``lm_head.weight`` beside ``model.embed_tokens.weight``. Prime-RL's ``update_weights`` (pause, update, resume)
applies it; each step's greedy tokens equal a transformers forward on that step's files, and after the tied model's
last step the server answers as a fresh engine started on that step's files (tokens and logprobs).

Engine: the tied model gets a server of its own (one start, ~20 CPU-seconds; 16 KV blocks); the untied steps run on
the shared long-context server, put back at the end. The fresh engine is started ahead like the shared servers (one
more start): a subprocess writes the tied model's last step with the same writer and seeds first, and the test checks
that the step the server took holds the same tensors.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors import safe_open

from app.tiny.model import TINY_CONFIG, make_tiny_model
from tests.conftest import module_server, start_timeout
from tests.helpers import ROOT, ServerProcess, engine_env, free_port, metric_value, restore_server
from tests.prime_rl_src import launcher_argv, prime_rl_update, use_prime_rl
from tests.rl_steps import GEN, PROMPTS, greedy, reference_greedy
from tests.streaming import family, wait_gone

pytestmark = pytest.mark.engine

STEPS = 3
N = 8
SERVED = "Qwen/Qwen3-0.6B"  # the guide's model.name


@pytest.fixture(scope="module")
def tied_server(prime_tito: ServerProcess) -> ServerProcess:
    """The tiny tied model, started with Prime-RL's launcher's own command line and served under the guide's name."""
    return prime_tito


@pytest.fixture(scope="module")
def untied_server(long_tito: ServerProcess) -> Iterator[ServerProcess]:
    yield long_tito
    restore_server(long_tito.url)


@pytest.fixture(scope="module")
def trainer_group() -> Iterator[None]:
    """The one-rank gloo group Prime-RL's writer runs its barriers and gathers in."""
    import torch.distributed as dist

    use_prime_rl()
    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    if mine:
        dist.destroy_process_group()


def trainer_model(model_dir: Path, step: int) -> torch.nn.Module:
    """The served model's weights moved by ``step`` seeded steps, sharded with FSDP2 as Prime-RL's trainer shards it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    gen = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():  # a tied pair is one parameter: moved once
            for _ in range(step):
                p.add_(torch.randn(p.shape, generator=gen) * 0.05 * (p.std() if p.numel() > 1 else 1.0))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    return model


def write_step(model: torch.nn.Module, step_dir: Path) -> None:
    """What ``FileSystemWeightBroadcast.broadcast_weights`` runs for a full model, then its ``STABLE`` marker."""
    from prime_rl.utils.weights import convert_state_dict_to_hf, gather_weights_parallel, save_state_dict_parallel

    state_dict = gather_weights_parallel(model)
    state_dict = convert_state_dict_to_hf(model, state_dict)
    save_state_dict_parallel(state_dict, step_dir)
    (step_dir / "STABLE").touch()


def write_last_step(model_dir: str, step_dir: str) -> None:
    """The tied model's last step as the test writes it (run in a subprocess: its own one-rank gloo group)."""
    import torch.distributed as dist

    use_prime_rl()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        write_step(trainer_model(Path(model_dir), STEPS), Path(step_dir))
    finally:
        dist.destroy_process_group()


@module_server("fresh-step")
def start_fresh(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> ServerProcess:
    """A fresh engine on the tied model's last step files (``make_tiny_model`` is deterministic: the same base as
    ``prime_tito``'s), with the command line Prime-RL's launcher builds, as ``prime_tito``."""
    root = tmp_path_factory.mktemp("fresh-step")
    base = make_tiny_model(root / "base", tied=True)
    step_dir = root / f"step_{STEPS}"
    code = "import sys; from tests.test_prime_rl_writer import write_last_step; write_last_step(*sys.argv[1:])"
    subprocess.run([sys.executable, "-c", code, str(base), str(step_dir)], cwd=str(ROOT), check=True, timeout=300,
                   capture_output=True)
    model = shutil.copytree(base, root / "model")
    shutil.copy(step_dir / "model.safetensors", model / "model.safetensors")  # the head's copy included, as written
    port = free_port()
    argv = [*launcher_argv(port, model), "--num-kv-blocks", "16"]
    server = ServerProcess([sys.executable, "-m", "tito", "serve", *argv], port, root / "fresh-step.log",
                           env=engine_env(None))
    server.step_dir = step_dir  # type: ignore[attr-defined]
    return server.start(timeout=start_timeout())


def greedy_logprobs(c: httpx.Client) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens and their logprobs."""
    out = []
    for p in PROMPTS:
        r = c.post(GEN, json={"token_ids": p, "sampling_params": {"max_tokens": N, "temperature": 0, "logprobs": 1}})
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        out.append((ch["token_ids"], [e["logprob"] for e in ch["logprobs"]["content"]]))
    return out


def reference(step_dir: Path, config: dict, out: Path) -> list[list[int]]:
    """transformers greedy on the step's own files, in float32 (the served dtype)."""
    with safe_open(str(step_dir / "model.safetensors"), "pt") as f:
        sd = {k: f.get_tensor(k) for k in f.keys()}
    if config.get("tie_word_embeddings"):
        sd.pop("lm_head.weight")
    return reference_greedy(sd, out, PROMPTS, N, config=config)


def apply_with_prime_rl(url: str, step_dir: Path, step: int) -> None:
    """Prime-RL's orchestrator's call for a full-model step: ``update_weights`` on its admin clients."""
    asyncio.run(prime_rl_update(url, step_dir, step))


def model_of(server: ServerProcess) -> Path:
    return Path(server.cmd[server.cmd.index("--model") + 1])


def run_steps(server: ServerProcess, tmp: Path) -> list[list[list[int]]]:
    model_dir = model_of(server)
    config = json.loads((model_dir / "config.json").read_text())
    answers = []
    with httpx.Client(base_url=server.url, timeout=120) as c:
        base = greedy(c, PROMPTS, N)
        for step in range(1, STEPS + 1):
            step_dir = tmp / "broadcasts" / f"step_{step}"
            write_step(trainer_model(model_dir, step), step_dir)
            with safe_open(str(step_dir / "model.safetensors"), "pt") as f:
                names = set(f.keys())
            assert "lm_head.weight" in names and "model.embed_tokens.weight" in names
            apply_with_prime_rl(server.url, step_dir, step)
            got = greedy(c, PROMPTS, N)
            assert got == reference(step_dir, config, tmp / f"ref_{step}"), f"step {step}"
            answers.append(got)
        assert any(a != base for a in answers), "the steps never changed the greedy answer: the test proves nothing"
    return answers


def test_tied_model_takes_prime_rl_writer_steps(trainer_group, tied_server, shared_servers, tmp_path) -> None:
    run_steps(tied_server, tmp_path)
    # A fresh engine on the last step's files answers as the server that took the three steps.
    fresh = shared_servers.get("fresh-step")
    last = tmp_path / "broadcasts" / f"step_{STEPS}" / "model.safetensors"
    with safe_open(str(last), "pt") as f, safe_open(str(fresh.step_dir / "model.safetensors"), "pt") as g:
        assert set(f.keys()) == set(g.keys())
        assert all(torch.equal(f.get_tensor(k), g.get_tensor(k)) for k in f.keys()), "not the same step"
    with httpx.Client(base_url=tied_server.url, timeout=120) as c:
        updated = greedy_logprobs(c)
    with httpx.Client(base_url=fresh.url, timeout=120) as c:
        started = greedy_logprobs(c)
    assert started == updated  # tokens and logprobs, bit for bit: the same weights, the same engine
    # The answer says what it skipped: the head's copy, checked equal to the embedding.
    step_dir = tmp_path / "broadcasts" / f"step_{STEPS}"
    r = httpx.post(f"{tied_server.url}/update_weights", json={"weight_dir": str(step_dir), "weight_version": "again"},
                   timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["skipped"] == ["lm_head.weight"]


def test_tied_head_that_differs_is_refused(trainer_group, tied_server, tmp_path) -> None:
    """A head that is not a copy of the embedding would be dropped silently by vLLM's loader: refused, naming it,
    and the served weights stay as they were."""
    from safetensors.torch import save_file

    model_dir = model_of(tied_server)
    step_dir = tmp_path / "step_1"
    write_step(trainer_model(model_dir, 1), step_dir)
    with safe_open(str(step_dir / "model.safetensors"), "pt") as f:
        sd = {k: f.get_tensor(k) for k in f.keys()}
    sd["lm_head.weight"] = sd["lm_head.weight"].clone()
    sd["lm_head.weight"][3, 5] += 1
    save_file(sd, str(step_dir / "model.safetensors"))
    with httpx.Client(base_url=tied_server.url, timeout=120) as c:
        before = greedy(c, PROMPTS, N)
        r = c.post("/update_weights", json={"weight_dir": str(step_dir)})
        assert r.status_code == 400, r.text
        msg = r.json()["error"]["message"]
        assert "'lm_head.weight' differs from 'model.embed_tokens.weight'" in msg and "tie_word_embeddings" in msg
        assert greedy(c, PROMPTS, N) == before
        r = c.post(GEN, json={"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}})
        assert r.status_code == 200


def test_tied_model_takes_the_trainers_broadcast(tied_server, tmp_path) -> None:
    """Prime-RL's broadcast wire (over gloo) of a tied model's state dict: the head's copy is checked and skipped."""
    from app.tiny.model import tiny_state_dict
    from tests.test_broadcast import Sender

    port = free_port()
    step_dir = tmp_path / "step_1"
    sender = Sender(port, [(step_dir, 31)], tied=True)
    tied_config = {**TINY_CONFIG, "tie_word_embeddings": True}
    with httpx.Client(base_url=tied_server.url, timeout=300) as c:
        try:
            r = c.post("/init_broadcaster", json={"host": "127.0.0.1", "port": port, "rank_offset": 0,
                                                  "inference_world_size": 1, "timeout": 240})
            assert r.status_code == 200, r.text
            (step_dir / "NCCL_READY").touch()
            r = c.post("/update_weights", json={"weight_dir": str(step_dir)})
            assert r.status_code == 200, r.text
            assert r.json()["source"] == "broadcast" and r.json()["skipped"] == ["lm_head.weight"]
            sd = tiny_state_dict(31, tied_config)
            assert greedy(c, PROMPTS, N) == reference_greedy(sd, tmp_path / "ref", PROMPTS, N, config=tied_config)
            assert "sent step_1" in sender.finish()
        finally:
            sender.kill()
    restore_server(tied_server.url, drop_broadcaster=True)


def test_untied_model_takes_prime_rl_writer_steps(trainer_group, untied_server, tmp_path) -> None:
    assert json.loads((model_of(untied_server) / "config.json").read_text())["tie_word_embeddings"] is False
    run_steps(untied_server, tmp_path)


def test_tiny_tied_model_is_tied(tmp_path) -> None:
    d = make_tiny_model(tmp_path / "m", tied=True, tokenizer=False)
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    assert json.loads((d / "config.json").read_text()) == {**TINY_CONFIG, "tie_word_embeddings": True}
    assert os.path.getsize(d / "model.safetensors") > 0


def test_prefix_cache_follows_the_callers_pause(trainer_group, tied_server, tmp_path) -> None:
    """Prime-RL's step (``/pause?mode=keep&clear_cache=false``, update, resume) keeps the prefix cache, as vLLM and
    Prime-RL's server do: a rollout's next turn under its version's ``cache_salt`` reuses its prompt's KV instead of
    prefilling it again, and another version's salt finds none. An update without such a pause (tito pauses
    itself), or under a pause that clears the cache (vLLM's default), resets it: no old KV is served. Shown with the
    engine's prefix-cache hit counter; the figure is the prefill saved per step."""
    prompt = [(11 * i) % 500 + 3 for i in range(200)]

    def turn(c: httpx.Client, salt: str | None) -> tuple[int, float]:
        hits0 = metric_value(c.get("/metrics").text, "vllm:prefix_cache_hits_total") or 0.0
        salted = {"cache_salt": salt} if salt is not None else {}
        r = c.post(GEN, json={"token_ids": prompt, **salted, "sampling_params": {"max_tokens": 1}})
        assert r.status_code == 200, r.text
        cached = int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] or 0)
        hits = (metric_value(c.get("/metrics").text, "vllm:prefix_cache_hits_total") or 0.0) - hits0
        assert hits == cached, (hits, cached)
        return cached, hits

    model_dir = model_of(tied_server)
    steps = []
    for k in (1, 2, 3):
        steps.append(tmp_path / f"step_{k}")
        write_step(trainer_model(model_dir, k), steps[-1])
    with httpx.Client(base_url=tied_server.url, timeout=120) as c:
        turn(c, "v0")
        cached, _ = turn(c, "v0")
        assert 0 < cached <= len(prompt) - 1
        full = cached  # the block-aligned prefix the engine caches
        turn(c, None)
        assert turn(c, None)[0] == full  # a caller that never salts reuses its KV too
        # Prime-RL's step: the cache is kept, versions are kept apart by the salt.
        apply_with_prime_rl(tied_server.url, steps[0], 1)
        saved, _ = turn(c, "v0")
        assert saved == full
        assert turn(c, "v1")[0] == 0
        # A request without a salt never reads the old weights' KV: tito salts it with the new weights'.
        assert turn(c, None)[0] == 0 and turn(c, None)[0] == full
        print(f"prefill saved per Prime-RL step: {saved} of {len(prompt)} prompt tokens for each kept turn")
        # No pause from the caller: tito pauses itself and resets the cache.
        r = c.post("/update_weights", json={"weight_dir": str(steps[1])})
        assert r.status_code == 200, r.text
        assert turn(c, "v1")[0] == 0
        turn(c, "v2")
        # vLLM's default pause (clear_cache=true, ignored by keep itself): the update resets the cache.
        assert c.post("/pause", params={"mode": "keep"}).json() == {"status": "paused"}
        try:
            assert c.post("/update_weights", json={"weight_dir": str(steps[2])}).status_code == 200
        finally:
            assert c.post("/resume").json() == {"status": "resumed"}
        assert turn(c, "v2")[0] == 0


def test_prime_rl_model_check_passes_with_the_guides_start_command(trainer_group, tied_server) -> None:
    """The guide starts tito with ``--served-model-name`` = Prime-RL's ``model.name``: Prime-RL's own startup check
    (``maybe_check_has_model`` on every admin URL) passes; a name tito does not serve fails it."""
    from prime_rl.configs.shared import ClientConfig
    from prime_rl.utils.client import maybe_check_has_model, setup_admin_clients

    async def check(name: str) -> None:
        clients = setup_admin_clients(ClientConfig(base_url=f"{tied_server.url}/v1",
                                                   admin_base_url=[f"{tied_server.url}/v1"]))
        try:
            await maybe_check_has_model(clients, name)
        finally:
            for c in clients:
                await c.aclose()

    asyncio.run(check(SERVED))
    with pytest.raises(ValueError, match="was not found in the inference pool"):
        asyncio.run(check("Qwen/Qwen3-8B"))


def test_tied_model_takes_a_staged_delta_with_the_heads_copy(tied_server, tmp_path) -> None:
    """A staged delta of a tied model's state dict changes ``lm_head.weight`` exactly as the embedding: accepted, the
    head's record dropped, made ready before the pause (the embedding written in place at commit, the head's kernel
    built ahead from the embedding's target: nothing reloaded under the pause), and the committed weights answer as
    transformers on them; a head record that differs from the embedding's is refused at the stage, naming both."""

    from app.tiny.model import DEFAULT_SEED, tiny_state_dict
    from tests.delta_encoder import perturb, write_delta

    config = {**TINY_CONFIG, "tie_word_embeddings": True}

    def with_head(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {**sd, "lm_head.weight": sd["model.embed_tokens.weight"].clone()}

    base = tiny_state_dict(DEFAULT_SEED, config)
    target = perturb(base, 0.2, seed=5, scale=0.5)
    with httpx.Client(base_url=tied_server.url, timeout=600) as c:
        assert c.post("/reload_weights").status_code == 200
        d = tmp_path / "step_1"
        write_delta(d / "delta.safetensors", with_head(base), with_head(target))
        r = c.post("/stage", data={"version": "d1", "mode": "delta", "base_version": "base", "path": str(d)})
        assert r.status_code == 200 and r.json()["ready"] is True, r.text
        assert c.post("/pause", params={"mode": "keep", "clear_cache": "false"}).status_code == 200
        try:
            r = c.post("/commit", data={"version": "d1", "mode": "delta"})
            assert r.status_code == 200, r.text
        finally:
            assert c.post("/resume").json() == {"status": "resumed"}
        w = r.json()["workers"]
        assert w["prepared"] is True and w["reloaded_groups"] == 0 and w["inplace"] > 0 and w["prebuilt"] > 0, w
        copies = c.get("/server_info").json()["state"]["staging"]["workers"]
        assert {x["copy"] for x in copies} == {"memory"}, copies  # the default (long_tito runs --delta-copy file)
        assert greedy(c, PROMPTS, N) == reference_greedy(target, tmp_path / "ref", PROMPTS, N, config=config)
        bad = with_head(target)
        bad["lm_head.weight"][0, 0] += 1.0
        write_delta(tmp_path / "step_2" / "delta.safetensors", with_head(target), bad)
        r = c.post("/stage", data={"version": "d2", "mode": "delta", "base_version": "d1",
                                   "path": str(tmp_path / "step_2")})
        assert r.status_code == 400, r.text
        assert "'lm_head.weight' changes differently from 'model.embed_tokens.weight'" in r.text
    restore_server(tied_server.url)


@pytest.mark.ends_server("prime_tito")
def test_make_seed_runs_stop_logs_no_engine_death(ending_server: ServerProcess) -> None:
    """``make seed-run``'s stop (scripts/prime_run/run.py ``stop_in_order``: SIGTERM to tito alone, as a supervisor
    signals it) on the server Prime-RL's launcher's command line started: tito stops its engine itself, in order, exits
    0, and logs no engine death. Signalling tito's whole process group, as the seed run did, had the engine core take
    the signal first, and tito logged ``engine is dead: EngineCore ... exited with code 1`` on a normal stop."""
    from scripts.prime_run.run import stop_in_order

    s = ending_server
    assert s.proc is not None
    procs = family(s.proc.pid)
    assert any("EngineCore" in p.name() for p in procs)
    start = len(s.log_text())
    assert stop_in_order(s.proc, timeout=120) == 0, s.log_tail()
    log = s.log_text()[start:]
    assert "engine is dead" not in log and not re.search(r"\bERROR\b", log), log[-3000:]
    assert wait_gone(procs, 15) == []
