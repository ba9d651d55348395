"""LoRA adapters on the real engine: load, in-place reload, unload, per-request selection, and refusals.

Adapters are written here in PEFT's layout (q_proj/v_proj). The reference for an adapter is a transformers forward
pass on a model directory whose weights are the base weights with the delta merged in: W + B·A·alpha/r.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import LORA_CONTEXT
from tests.helpers import ServerProcess, metric_value, restore_server
from tests.reference import Reference
from tests.sweep import fire, shapes

pytestmark = pytest.mark.engine

GEN = "/inference/v1/generate"
RANK, ALPHA = 8, 16
PROMPTS = [[1, 2, 3, 4, 5], [17, 300, 42, 9]]
LONG = [i % 500 + 1 for i in range(300)]  # fills whole KV blocks, so a prefix-cache hit is possible
N = 8

Adapter = dict[str, tuple[torch.Tensor, torch.Tensor]]  # module name → (lora_A [r, in], lora_B [out, r])


def make_weights(base: dict[str, torch.Tensor], seed: int, targets: tuple[str, ...] = ("q_proj", "v_proj"),
                 rank: int = RANK) -> Adapter:
    gen = torch.Generator().manual_seed(seed)
    out: Adapter = {}
    for key, w in base.items():
        module = key.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in targets:
            a = torch.randn(rank, w.shape[1], generator=gen) * 0.1
            b = torch.randn(w.shape[0], rank, generator=gen) * 0.1
            out[module] = (a, b)
    assert out, "no target module found"
    return out


def write_adapter(path: Path, weights: Adapter, *, rank: int = RANK, alpha: int = ALPHA,
                  targets: list[str] | None = None) -> Path:
    """An adapter directory as PEFT saves it: adapter_config.json + adapter_model.safetensors."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
           "bias": "none", "target_modules": targets or sorted({m.rsplit(".", 1)[-1] for m in weights}),
           "base_model_name_or_path": "tiny-qwen3", "use_rslora": False, "use_dora": False}
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    tensors = {}
    for module, (a, b) in weights.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    return path


def merged_reference(base_dir: Path, base: dict[str, torch.Tensor], weights: Adapter, out: Path) -> Reference:
    """transformers on base weights with the LoRA delta merged in: W + B·A·alpha/r."""
    merged = dict(base)
    for module, (a, b) in weights.items():
        merged[module + ".weight"] = base[module + ".weight"] + (b @ a) * (ALPHA / RANK)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(base_dir / "config.json", out / "config.json")
    save_file(merged, str(out / "model.safetensors"), metadata={"format": "pt"})
    return Reference(out)


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def lora_server(lora_tito: ServerProcess) -> Iterator[ServerProcess]:
    """The session's shared LoRA server (``--enable-lora --max-lora-rank 8 --max-loras 2``, and a stream interval
    no test here streams with). Every test unloads what it loads; put back at the end all the same."""
    assert RANK == 8  # the shared server's --max-lora-rank
    yield lora_tito
    restore_server(lora_tito.url)


@pytest.fixture
def lc(lora_server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=lora_server.url, timeout=120.0) as c:
        yield c


@pytest.fixture(scope="module")
def base_sd(tiny_model: Path) -> dict[str, torch.Tensor]:
    return load_file(str(tiny_model / "model.safetensors"))


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora")


@pytest.fixture(scope="module")
def w1(base_sd: dict[str, torch.Tensor]) -> Adapter:
    return make_weights(base_sd, seed=1)


@pytest.fixture(scope="module")
def w2(base_sd: dict[str, torch.Tensor]) -> Adapter:
    return make_weights(base_sd, seed=2)


@pytest.fixture(scope="module")
def ref1(tiny_model: Path, base_sd: dict[str, torch.Tensor], w1: Adapter, work: Path) -> Reference:
    return merged_reference(tiny_model, base_sd, w1, work / "merged1")


@pytest.fixture(scope="module")
def ref2(tiny_model: Path, base_sd: dict[str, torch.Tensor], w2: Adapter, work: Path) -> Reference:
    return merged_reference(tiny_model, base_sd, w2, work / "merged2")


@pytest.fixture(scope="module")
def base_ref(tiny_model: Path) -> Reference:
    return Reference(tiny_model)


def greedy(c: httpx.Client, prompt: list[int], model: str | None = None, n: int = N) -> tuple[list[int], list[float]]:
    body: dict = {"token_ids": prompt, "sampling_params": {"max_tokens": n, "temperature": 0, "logprobs": 0}}
    if model is not None:
        body["model"] = model
    r = c.post(GEN, json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["model"] == (model or c.get("/v1/models").json()["data"][0]["id"])
    ch = data["choices"][0]
    return ch["token_ids"], [e["logprob"] for e in ch["logprobs"]["content"]]


def assert_matches(got: tuple[list[int], list[float]], ref: Reference, prompt: list[int], n: int = N) -> None:
    toks, lps = ref.greedy(prompt, n)
    assert got[0] == toks
    assert got[1] == pytest.approx(lps, abs=2e-3)


def load(c: httpx.Client, name: str, path: Path, route: str = "/load_lora_adapter", **extra: object) -> httpx.Response:
    return c.post(route, json={"lora_name": name, "lora_path": str(path), **extra})


def view(c: httpx.Client, name: str) -> dict:
    entries = {e["lora_name"]: e for e in c.get("/lora_adapters").json()["data"]}
    return entries[name]


def unload(c: httpx.Client, name: str) -> None:
    r = c.post("/v1/unload_lora_adapter", json={"lora_name": name})
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------------------------------------ tests


def test_references_differ(base_ref: Reference, ref1: Reference, ref2: Reference) -> None:
    # Guards the tests' power: the two adapters and the base must give different greedy answers.
    for p in PROMPTS:
        outs = [r.greedy(p, N)[0] for r in (base_ref, ref1, ref2)]
        assert outs[0] != outs[1] and outs[1] != outs[2] and outs[0] != outs[2]


def test_adapter_output_matches_merged_reference(lc, w1, ref1, base_ref, work) -> None:
    path = write_adapter(work / "a1", w1)
    r = load(lc, "a1", path, "/v1/load_lora_adapter")
    assert r.status_code == 200, r.text
    assert r.text == "Success: LoRA adapter 'a1' added successfully."
    try:
        models = lc.get("/v1/models").json()["data"]
        base = models[0]
        assert base["parent"] is None and base["max_model_len"] == LORA_CONTEXT
        card = next(m for m in models if m["id"] == "a1")
        assert card["parent"] == base["id"] and card["root"] == str(path.resolve())
        for p in PROMPTS:
            assert_matches(greedy(lc, p, "a1"), ref1, p)
            # Base by no model and by its own name, in the same server.
            assert_matches(greedy(lc, p), base_ref, p)
            assert_matches(greedy(lc, p, base["id"]), base_ref, p)
        entry = view(lc, "a1")
        assert entry["rank"] == RANK and entry["alpha"] == ALPHA and entry["target_modules"] == ["q_proj", "v_proj"]
    finally:
        unload(lc, "a1")


def test_v1_semantics_reload_and_unload(lc, w1, w2, ref1, ref2, base_ref, work) -> None:
    p1, p2 = write_adapter(work / "v1-step0", w1), write_adapter(work / "v1-step1", w2)
    assert load(lc, "v1x", p1, "/v1/load_lora_adapter").status_code == 200
    first_id = view(lc, "v1x")["lora_int_id"]
    # An existing name without load_inplace: vLLM's 400, and the adapter is untouched.
    r = load(lc, "v1x", p2, "/v1/load_lora_adapter")
    assert r.status_code == 400
    assert "already been loaded" in r.json()["error"]["message"]
    assert_matches(greedy(lc, PROMPTS[0], "v1x"), ref1, PROMPTS[0])
    r = load(lc, "v1x", p2, "/v1/load_lora_adapter", load_inplace=True)
    assert r.status_code == 200, r.text
    entry = view(lc, "v1x")
    assert entry["lora_int_id"] == first_id and entry["reloads"] == 1 and entry["lora_path"] == str(p2.resolve())
    assert entry["request"]["load_inplace"] is False
    assert_matches(greedy(lc, PROMPTS[0], "v1x"), ref2, PROMPTS[0])

    r = lc.post("/v1/unload_lora_adapter", json={"lora_name": "v1x"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'v1x' removed successfully."
    # Back to base: the name is gone everywhere, the base answers as before.
    r = lc.post(GEN, json={"token_ids": PROMPTS[0], "model": "v1x", "sampling_params": {"max_tokens": 1}})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert "v1x" not in [m["id"] for m in lc.get("/v1/models").json()["data"]]
    assert_matches(greedy(lc, PROMPTS[0]), base_ref, PROMPTS[0])
    r = lc.post("/v1/unload_lora_adapter", json={"lora_name": "v1x"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    # The name can be loaded again afterwards, under a fresh id.
    assert load(lc, "v1x", p1, "/v1/load_lora_adapter").status_code == 200
    try:
        assert view(lc, "v1x")["lora_int_id"] > first_id
        assert_matches(greedy(lc, PROMPTS[1], "v1x"), ref1, PROMPTS[1])
    finally:
        unload(lc, "v1x")


def test_prime_rl_inplace_reload_flag_is_not_sticky(lc, lora_server, w1, w2, ref1, ref2, work) -> None:
    """Prime-RL's loop: same name every step, new directory. The stored request must not keep load_inplace."""
    step0, step1 = write_adapter(work / "broadcasts" / "step_0", w1), write_adapter(work / "broadcasts" / "step_1", w2)
    name = f"r{RANK}-a{ALPHA}"
    metrics0 = lc.get("/metrics").text
    r = load(lc, name, step0)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    try:
        lora_id = view(lc, name)["lora_int_id"]
        assert_matches(greedy(lc, PROMPTS[0], name), ref1, PROMPTS[0])

        r = load(lc, name, step1)
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        entry = view(lc, name)
        assert entry["lora_int_id"] == lora_id and entry["reloads"] == 1
        # What generation sends to the engine does not carry the in-place flag.
        assert entry["request"] == {"lora_name": name, "lora_int_id": lora_id, "lora_path": str(step1.resolve()),
                                    "load_inplace": False}
        assert_matches(greedy(lc, PROMPTS[0], name), ref2, PROMPTS[0])

        # Observable: the engine serves the weights it loaded, not what is on disk now. A sticky flag re-reads the
        # adapter every step, so overwriting step_1 with step_0's weights would turn the output into ref1, and
        # deleting it would fail the generation.
        write_adapter(step1, w1)
        assert_matches(greedy(lc, PROMPTS[0], name, n=12), ref2, PROMPTS[0], n=12)
        shutil.rmtree(step1)
        assert_matches(greedy(lc, PROMPTS[1], name, n=12), ref2, PROMPTS[1], n=12)
        assert lc.get("/health").status_code == 200

        # Loads are counted and logged with the seconds they took.
        metrics1 = lc.get("/metrics").text
        for kind in ("load", "reload"):
            before = metric_value(metrics0, "tito_lora_loads_total", {"kind": kind, "outcome": "ok"}) or 0.0
            assert metric_value(metrics1, "tito_lora_loads_total", {"kind": kind, "outcome": "ok"}) == before + 1
        assert (metric_value(metrics1, "tito_lora_load_seconds_count") or 0) >= 2
        logs = lora_server.log_text()
        assert re.search(rf"LoRA adapter reload '{name}' \(id {lora_id}, rank {RANK}, 4 modules\) from \S+step_1 "
                         r"in \d+\.\d\ds", logs), lora_server.log_tail()
    finally:
        unload(lc, name)


def test_same_path_reload_does_not_reuse_stale_prefix_cache(lc, w1, w2, ref1, ref2, work) -> None:
    path = write_adapter(work / "fixed", w1)
    assert load(lc, "fixed", path).status_code == 200
    try:
        assert_matches(greedy(lc, LONG, "fixed", n=4), ref1, LONG, n=4)
        assert_matches(greedy(lc, LONG, "fixed", n=4), ref1, LONG, n=4)  # now its prefix blocks are cached
        write_adapter(path, w2)
        assert load(lc, "fixed", path).status_code == 200
        assert_matches(greedy(lc, LONG, "fixed", n=4), ref2, LONG, n=4)
    finally:
        unload(lc, "fixed")


def test_concurrent_base_and_adapter_requests_get_their_own_answers(lc, lora_server, w1, ref1, base_ref,
                                                                    work) -> None:
    assert load(lc, "cc", write_adapter(work / "cc", w1)).status_code == 200
    try:
        prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5], [35, 89, 79], [32, 38, 46, 26, 43], [100, 200], [7, 7, 7, 7]]
        jobs = [(p, "cc" if i % 2 else None) for i, p in enumerate(prompts)]

        def run(job: tuple[list[int], str | None]) -> tuple[list[int], list[float]]:
            with httpx.Client(base_url=lora_server.url, timeout=120.0) as c:
                return greedy(c, job[0], job[1], n=16)

        with ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(run, jobs))
        for (prompt, model), got in zip(jobs, results, strict=True):
            assert_matches(got, ref1 if model else base_ref, prompt, n=16)
    finally:
        unload(lc, "cc")


ISSUE_31 = {"token_ids": [3, 1, 4, 1, 5], "sampling_params": {"n": 2, "max_tokens": 4, "prompt_logprobs": 2, "seed": 8}}


def test_prompt_logprobs_on_a_lora_server_are_served_and_the_engine_lives(lc, client) -> None:
    """SkyRL's sample request (n=2, prompt logprobs, no adapter) used to kill this server's EngineCore (vLLM's LoRA LM
    head mapped one adapter row per request onto one row per prompt token). It is served now, on the token and the
    OpenAI routes, with the values of the server without LoRA (exactness per adapter: tests/test_lora_exactness.py)."""
    r = lc.post(GEN, json=ISSUE_31)
    assert r.status_code == 200, r.text
    plp = r.json()["prompt_logprobs"]
    assert plp[0] is None and all(len(step) >= 2 for step in plp[1:]) and len(plp) == 5
    ref = client.post(GEN, json=ISSUE_31)
    assert ref.status_code == 200, ref.text
    for got, want in zip(plp[1:], ref.json()["prompt_logprobs"][1:], strict=True):
        assert {k: v["logprob"] for k, v in got.items()} == pytest.approx(
            {k: v["logprob"] for k, v in want.items()}, abs=1e-4)
    # The OpenAI route too (TRL scores teachers with prompt_logprobs; echo + logprobs asks for them implicitly).
    for body in ({"prompt": [3, 1, 4, 1, 5], "max_tokens": 1, "prompt_logprobs": 1},
                 {"prompt": [3, 1, 4, 1, 5], "max_tokens": 1, "echo": True, "logprobs": 1, "return_token_ids": True}):
        r = lc.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
    assert lc.get("/server_info").json()["features"]["prompt_logprobs"] is True
    assert lc.get("/health").status_code == 200


def test_trainer_request_shapes_together_keep_the_engine(lc, lora_server, w1, work) -> None:
    """The request-shape sweep on the LoRA configuration: Prime-RL, TRL and SkyRL shapes at once, some by adapter
    name."""
    assert load(lc, "sweep", write_adapter(work / "sweep", w1)).status_code == 200
    try:
        for model in ("sweep", None):
            bodies = shapes(model=model)
            fire(lora_server.url, bodies)
    finally:
        unload(lc, "sweep")


def _truncate(p: Path) -> None:
    f = p / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])


def _garbage_header(p: Path) -> None:
    f = p / "adapter_model.safetensors"
    data = f.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    f.write_bytes(data[:8] + b"{" * n + data[8 + n:])


def _huge_header(p: Path) -> None:
    f = p / "adapter_model.safetensors"
    f.write_bytes(struct.pack("<Q", 2**40) + f.read_bytes()[8:])


def _config(**kw: object):
    def edit(p: Path) -> None:
        cfg = json.loads((p / "adapter_config.json").read_text())
        cfg.update(kw)
        (p / "adapter_config.json").write_text(json.dumps(cfg))
    return edit


BAD = {
    "missing_dir": (lambda p: shutil.rmtree(p), 404, "does not exist"),
    "no_config": (lambda p: (p / "adapter_config.json").unlink(), 400, "adapter_config.json not found"),
    "config_not_json": (lambda p: (p / "adapter_config.json").write_text("{nope"), 400, "not valid JSON"),
    "no_weights": (lambda p: (p / "adapter_model.safetensors").unlink(), 400, "adapter_model.safetensors not found"),
    "truncated_weights": (_truncate, 400, "truncated"),
    "garbage_header": (_garbage_header, 400, "corrupt"),
    "huge_header": (_huge_header, 400, "corrupt"),
    "dora": (_config(use_dora=True), 400, "DoRA"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_adapter_is_a_clear_4xx_and_engine_keeps_serving(lc, w1, work, base_ref, case) -> None:
    path = write_adapter(work / f"bad-{case}", w1)
    damage, status, words = BAD[case]
    damage(path)
    r = load(lc, "bad", path)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["code"] == status
    assert "bad" not in [e["lora_name"] for e in lc.get("/lora_adapters").json()["data"]]
    assert_matches(greedy(lc, PROMPTS[0], n=4), base_ref, PROMPTS[0], n=4)


def test_rank_target_and_shape_refusals(lc, base_sd, w1, work) -> None:
    big = write_adapter(work / "rank16", make_weights(base_sd, seed=3, rank=16), rank=16)
    r = load(lc, "big", big)
    assert r.status_code == 400
    assert "rank 16 is greater than the server's max_lora_rank 8" in r.json()["error"]["message"]

    # Target modules the model lacks: adapter trained for another architecture.
    alien = {m.replace("q_proj", "query_key_value"): ab for m, ab in w1.items() if m.endswith("q_proj")}
    r = load(lc, "alien", write_adapter(work / "alien", alien, targets=["query_key_value"]))
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "targets module(s) the model does not have" in msg and "query_key_value" in msg

    # Right names, wrong shapes (lora_A for a different hidden size).
    wrong = {m: (torch.zeros(RANK, 256), b) for m, (a, b) in w1.items()}
    r = load(lc, "wrong", write_adapter(work / "wrong", wrong))
    assert r.status_code == 400 and "do not fit the model's weight" in r.json()["error"]["message"]

    # Config rank that the tensors do not have.
    r = load(lc, "lying", write_adapter(work / "lying", w1, rank=4))
    assert r.status_code == 400 and "configured rank 4" in r.json()["error"]["message"]

    assert lc.get("/lora_adapters").json()["data"] == []
    assert lc.get("/health").status_code == 200


def test_request_refusals(lc, lora_server, w1, work, tmp_path_factory) -> None:
    good = write_adapter(work / "good", w1)
    base_name = lc.get("/v1/models").json()["data"][0]["id"]
    r = load(lc, base_name, good)
    assert r.status_code == 400 and "conflicts with a served base model" in r.json()["error"]["message"]
    r = load(lc, "", good)
    assert r.status_code == 400 and "must be provided" in r.json()["error"]["message"]
    r = lc.post("/load_lora_adapter", json={"lora_name": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body.lora_path"
    r = load(lc, "outside", Path("/etc"))
    assert r.status_code == 403
    r = lc.post("/v1/unload_lora_adapter", json={"lora_name": "never-loaded"})
    assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]
    r = lc.post(GEN, json={"token_ids": [1, 2], "model": "never-loaded", "sampling_params": {"max_tokens": 1}})
    assert r.status_code == 404
    errors = metric_value(lc.get("/metrics").text, "tito_lora_loads_total", {"outcome": "error"})
    assert errors is not None and errors >= 1


def test_openai_routes_pick_the_adapter_by_model(lc, w1, ref1, work) -> None:
    """/v1/completions and /v1/chat/completions select an adapter by ``model`` exactly as the token API does (vLLM's
    handlers see tito's registry); an unknown name is vLLM's 404."""
    assert load(lc, "openai-r8", write_adapter(work / "openai-r8", w1)).status_code == 200
    try:
        prompt = PROMPTS[1]
        want = greedy(lc, prompt, "openai-r8")
        assert_matches(want, ref1, prompt)
        r = lc.post("/v1/completions", json={"model": "openai-r8", "prompt": prompt, "max_tokens": N, "temperature": 0,
                                             "logprobs": 0, "return_token_ids": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert r.json()["model"] == "openai-r8" and choice["token_ids"] == want[0]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(want[1], abs=1e-4)
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
                "return_token_ids": True}
        ids = lc.post("/tokenize", json={"messages": chat["messages"]}).json()["tokens"]
        r = lc.post("/v1/chat/completions", json={**chat, "model": "openai-r8"})
        assert r.json()["choices"][0]["token_ids"] == greedy(lc, ids, "openai-r8", 4)[0]
        r = lc.post("/v1/completions", json={"model": "never-loaded", "prompt": prompt, "max_tokens": 1})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    finally:
        unload(lc, "openai-r8")


def test_lora_disabled_is_a_clear_400(client) -> None:
    """The shared server runs without --enable-lora: every LoRA call is refused, nothing changes."""
    for route in ("/load_lora_adapter", "/v1/load_lora_adapter"):
        r = client.post(route, json={"lora_name": "x", "lora_path": "/tmp/x"})
        assert r.status_code == 400
        assert "LoRA is not enabled" in r.json()["error"]["message"]
    r = client.post("/v1/unload_lora_adapter", json={"lora_name": "x"})
    assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]
    assert client.get("/lora_adapters").json() == {"enabled": False, "max_lora_rank": 0, "max_loras": 0,
                                                      "data": []}
    assert len(client.get("/v1/models").json()["data"]) == 1
