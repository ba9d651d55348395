"""The RL trainers' own vLLM clients, unchanged, against the shared tito: TRL 1.16 (``VLLMClient``, the async GRPO
client) and SkyRL 0.4 (``RemoteInferenceClient``, ``SkyrlWeightSyncClient``).

Each client runs in a subprocess, in its own environment (tests/trainer_clients/*_driver.py: TRL in this venv, which
has the vLLM it needs; SkyRL in ``TITO_TRAINERS_VENV``, Python 3.12, made by ``make trainers``), and reports what every
call returned. Every call that can run on a CPU must succeed, and what it returned must equal tito's own token API
for the same prompt and seed (token ids exactly, logprobs to 1e-4). The calls that need a GPU (vLLM's NCCL weight
transfer, sleep/wake) or a framework's own server (SkyRL's /skyrl/*, /fetch_weights) must fail the way
docs/guides/trainers.md says.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import ServerProcess, restore_server
from tests.venv_build import venv_python

pytestmark = pytest.mark.engine

GEN = "/inference/v1/generate"
DRIVERS = Path(__file__).parent / "trainer_clients"
TOL = 1e-4


def _trainers_python() -> Path | str:
    # make test builds SkyRL's venv in the background (trainers-bg): its failure fails the test, not a skip; a machine
    # without what it needs (Python 3.12) gets the reason, which the test reports as SkyRL's skip.
    return venv_python("SkyRL", "TITO_TRAINERS_BUILD", "TITO_TRAINERS_VENV", "trainers")


class _Driver:
    """One client driver in a subprocess. Both start at once and make their data-plane calls side by side (each
    imports its framework for tens of seconds); then, one after the other, their control-plane calls (``barrier`` in
    tests/trainer_clients/common.py): a pause from one would freeze or abort the other's rollouts."""

    def __init__(self, python: str | Path, script: str, *args: str) -> None:
        self.script = script
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([str(python), script, *args], cwd=DRIVERS, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.err, text=True,
                                     env={**os.environ, "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"})
        self.out: list[str] = []
        self.result: dict[str, Any] | None = None

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Until the driver has made its data-plane calls, ended, or (killed) overran ``timeout``."""
        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:  # vLLM's import logs to stdout too
                self.out.append(line)
                if line.strip() == "READY":
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout)
        if reader.is_alive():
            self.proc.kill()
            reader.join(30)

    def finish(self) -> dict[str, Any]:
        if self.result is None:
            try:
                out, _ = self.proc.communicate("go\n", timeout=600)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                out, _ = self.proc.communicate()
            self.out.append(out)
            text = "".join(self.out)
            line = next((x for x in reversed(text.splitlines()) if x.startswith("REPORT ")), None)
            self.err.seek(0)
            assert line is not None, f"{self.script} printed no report (rc {self.proc.returncode}):\n" \
                                     f"{self.err.read()[-3000:]}"
            self.result = dict(json.loads(line[len("REPORT "):]))
        return self.result


@pytest.fixture(scope="module")
def server(tito: ServerProcess) -> Any:
    yield tito
    restore_server(tito.url)  # the clients paused and resumed it


@pytest.fixture(scope="module")
def drivers(server: ServerProcess) -> dict[str, _Driver | str]:
    """Both clients' drivers, running side by side; a string says why one cannot run here."""
    model = str(httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"])
    out: dict[str, _Driver | str] = {}
    out["trl"] = (_Driver(sys.executable, "trl_driver.py", server.url) if importlib.util.find_spec("trl")
                  else "trl is not installed (make test installs the test extra)")
    py = _trainers_python()
    out["skyrl"] = py if isinstance(py, str) else _Driver(py, "skyrl_driver.py", server.url, model)
    running = [d for d in out.values() if isinstance(d, _Driver)]
    for d in running:
        d.wait_ready()
    for d in running:
        d.finish()
    return out


@pytest.fixture(scope="module")
def model(server: ServerProcess) -> str:
    return str(httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"])


def _report(drivers: dict[str, _Driver | str], name: str) -> dict[str, Any]:
    d = drivers[name]
    if isinstance(d, str):
        pytest.skip(d)
    return d.finish()


@pytest.fixture(scope="module")
def trl(drivers: dict[str, _Driver | str]) -> dict[str, Any]:
    return _report(drivers, "trl")


@pytest.fixture(scope="module")
def skyrl(drivers: dict[str, _Driver | str]) -> dict[str, Any]:
    return _report(drivers, "skyrl")


def ok(report: dict[str, Any], name: str) -> Any:
    entry = report[name]
    assert entry["ok"], f"{name}: {entry['error']}\n{entry.get('trace', '')}"
    return entry["value"]


def failed(report: dict[str, Any], name: str, *words: str) -> str:
    entry = report[name]
    assert not entry["ok"], f"{name} was expected to fail here, got {entry['value']!r}"
    assert all(w in entry["error"] for w in words), entry["error"]
    return str(entry["error"])


def token_api(url: str, token_ids: list[int], **sp: Any) -> dict[str, Any]:
    r = httpx.post(url + GEN, json={"token_ids": token_ids, "sampling_params": sp}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    body["choices"].sort(key=lambda c: c["index"])
    return dict(body)


def tokenize(url: str, **body: Any) -> list[int]:
    r = httpx.post(url + "/tokenize", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


def top_of(entry: dict[str, Any]) -> dict[int, float]:
    """The token API's logprob entry as {token id: logprob}: the sampled token and its top candidates."""
    return {entry["token_id"]: entry["logprob"], **{t["token_id"]: t["logprob"] for t in entry["top_logprobs"]}}


def assert_close(got: dict[int, float], want: dict[int, float]) -> None:
    """Every candidate the token API reports has the same logprob in the client's answer (the completions shape lists
    up to one candidate more: the sampled token *and* the top k)."""
    assert set(want) <= set(got), (got, want)
    assert all(abs(got[k] - want[k]) < TOL for k in want), (got, want)


# ------------------------------------------------------------------------------------------------ TRL


def test_trl_starts_against_tito(trl: dict[str, Any], model: str) -> None:
    """What made the trainer fail at start-up before: /server_info read as vLLM's (KeyError)."""
    assert ok(trl, "init") == {"model": model}
    assert ok(trl, "get_server_info") == {"dtype": "torch.float32", "weight_transfer_config": None}
    assert ok(trl, "get_world_size") == 1
    assert ok(trl, "async_grpo.wait_for_server_ready") is None
    assert ok(trl, "async_grpo.get_max_model_len") == 512
    assert ok(trl, "async_grpo.get_dtype") == "torch.float32"
    assert ok(trl, "async_grpo.get_world_size") == 1


def test_trl_generate_equals_the_token_api(trl: dict[str, Any], server: ServerProcess) -> None:
    """Seeded rollouts with n=2 over two token-id prompts (/v1/completions): the token API's tokens and logprobs."""
    out = ok(trl, "generate")
    prompts = [[1, 2, 3, 4, 5], [9, 10, 11]]
    assert out["prompt_ids"] == prompts
    for p, prompt in enumerate(prompts):
        ref = token_api(server.url, prompt, n=2, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
                        repetition_penalty=1.0, max_tokens=6, logprobs=2, seed=1234)
        for k, choice in enumerate(ref["choices"]):
            seq = p * 2 + k  # TRL: choices are prompt-major
            assert out["completion_ids"][seq] == choice["token_ids"]
            for pos, entry in enumerate(choice["logprobs"]["content"]):
                got = dict(zip(out["logprob_token_ids"][seq][pos], out["logprobs"][seq][pos], strict=True))
                assert_close(got, top_of(entry))
    greedy = ok(trl, "generate_greedy")
    ref = token_api(server.url, [20, 21, 22, 23], temperature=0.0, max_tokens=6, logprobs=0)["choices"][0]
    assert greedy["completion_ids"] == [ref["token_ids"]]
    assert [lp[0] for lp in greedy["logprobs"][0]] == pytest.approx([e["logprob"] for e in ref["logprobs"]["content"]],
                                                                     abs=TOL)


def test_trl_text_and_chat_equal_the_token_api_on_their_tokens(trl: dict[str, Any], server: ServerProcess) -> None:
    text = ok(trl, "generate_text")
    ids = tokenize(server.url, prompt="Hello world")
    assert text["prompt_ids"] == [ids]
    assert text["completion_ids"] == [token_api(server.url, ids, temperature=0.0, max_tokens=6)["choices"][0][
        "token_ids"]]
    chat = ok(trl, "chat")
    ids = tokenize(server.url, messages=[{"role": "user", "content": "Hi there"}], add_generation_prompt=True)
    assert chat["prompt_ids"] == [ids]
    ref = token_api(server.url, ids, temperature=0.0, max_tokens=6, logprobs=1)["choices"][0]
    assert chat["completion_ids"] == [ref["token_ids"]]
    for pos, entry in enumerate(ref["logprobs"]["content"]):
        got = dict(zip(chat["logprob_token_ids"][0][pos], chat["logprobs"][0][pos], strict=True))
        assert_close(got, top_of(entry))


def test_trl_teacher_logprobs_equal_the_token_api_prompt_logprobs(trl: dict[str, Any], server: ServerProcess) -> None:
    out = ok(trl, "get_sequence_logprobs")
    seq, start = [1, 2, 3, 4, 5, 6, 7, 8], 4
    ref = token_api(server.url, seq, max_tokens=1, temperature=1.0, prompt_logprobs=3)["prompt_logprobs"]
    for j, pos in enumerate(range(start, len(seq))):
        want = {int(t): v["logprob"] for t, v in ref[pos].items()}
        got = {t: lp for t, lp in zip(out["logprob_token_ids"][0][j], out["logprobs"][0][j], strict=True)
               if lp != float("-inf")}
        top3 = dict(sorted(want.items(), key=lambda kv: -kv[1])[:3])
        assert_close(got, top3)
        assert out["actual_token_ids"][0][j] == [seq[pos]]
        assert out["actual_logprobs"][0][j][0] == pytest.approx(want[seq[pos]], abs=TOL)


def test_trl_control_calls(trl: dict[str, Any]) -> None:
    assert ok(trl, "reset_prefix_cache") is None
    assert ok(trl, "async_grpo.pause") is None and ok(trl, "async_grpo.resume") is None


def test_trl_weight_sync_needs_a_gpu(trl: dict[str, Any]) -> None:
    """TRL's weight sync is vLLM's NCCL weight-transfer engine: no backend on a CPU server, and a 501 saying so."""
    failed(trl, "init_communicator", "no weight-transfer engine")
    for name in ("weight_update", "async_grpo.init_weight_transfer_engine", "async_grpo.start_weight_update",
                 "async_grpo.finish_weight_update"):
        failed(trl, name, "501", "needs a GPU")


# ------------------------------------------------------------------------------------------------ SkyRL


def test_skyrl_generate_equals_the_token_api(skyrl: dict[str, Any], server: ServerProcess) -> None:
    assert ok(skyrl, "get_world_size") == [1, 1]
    out = ok(skyrl, "generate")
    for i, prompt in enumerate(([1, 2, 3, 4, 5], [9, 10, 11])):
        ref = token_api(server.url, prompt, max_tokens=6, temperature=0.0, logprobs=0)["choices"][0]
        assert out["response_ids"][i] == ref["token_ids"]
        assert out["response_logprobs"][i] == pytest.approx([e["logprob"] for e in ref["logprobs"]["content"]],
                                                             abs=TOL)
        # Without a local tokenizer SkyRL detokenizes through /detokenize.
        r = httpx.post(server.url + "/detokenize", json={"tokens": ref["token_ids"]}, timeout=30)
        assert out["responses"][i] == r.json()["prompt"]
        assert out["stop_reasons"][i] == "length"


def test_skyrl_sample_equals_the_token_api(skyrl: dict[str, Any], server: ServerProcess) -> None:
    """Tinker's sample(): n=2, seeded, with top-2 prompt logprobs."""
    out = ok(skyrl, "sample")
    prompt = [1, 2, 3, 4, 5]
    ref = token_api(server.url, prompt, n=2, logprobs=0, prompt_logprobs=2, temperature=1.0, max_tokens=6, seed=42)
    assert [s["tokens"] for s in out["sequences"]] == [c["token_ids"] for c in ref["choices"]]
    for seq, choice in zip(out["sequences"], ref["choices"], strict=True):
        assert seq["logprobs"] == pytest.approx([e["logprob"] for e in choice["logprobs"]["content"]], abs=TOL)
    plp = ref["prompt_logprobs"]
    assert out["prompt_logprobs"][0] is None
    assert out["prompt_logprobs"][1:] == pytest.approx([plp[i][str(t)]["logprob"] for i, t in enumerate(prompt)
                                                        if i > 0], abs=TOL)
    assert all(len(top) == 2 for top in out["topk_prompt_logprobs"][1:])


def test_skyrl_openai_routes_equal_the_token_api(skyrl: dict[str, Any], server: ServerProcess) -> None:
    prompt = [1, 2, 3, 4, 5]
    ref = token_api(server.url, prompt, max_tokens=6, temperature=0.0, logprobs=1)["choices"][0]
    cmpl = ok(skyrl, "completion")["choices"][0]
    assert cmpl["token_ids"] == ref["token_ids"] and cmpl["prompt_token_ids"] == prompt
    assert cmpl["logprobs"]["token_logprobs"] == pytest.approx([e["logprob"] for e in ref["logprobs"]["content"]],
                                                               abs=TOL)
    assert cmpl["weight_versions"] == ref["weight_versions"]
    chat_ids = tokenize(server.url, messages=[{"role": "user", "content": "Hi there"}], add_generation_prompt=True)
    assert ok(skyrl, "render_chat_completion")["token_ids"] == chat_ids
    chat = ok(skyrl, "chat_completion")["choices"][0]
    assert chat["token_ids"] == token_api(server.url, chat_ids, max_tokens=6, temperature=0.0)["choices"][0][
        "token_ids"]
    assert ok(skyrl, "tokenize") == [tokenize(server.url, prompt="Hello world"), tokenize(server.url, prompt="Hi")]
    assert ok(skyrl, "detokenize")[0] == "Hello world"


def test_skyrl_control_plane(skyrl: dict[str, Any], server: ServerProcess) -> None:
    for name in ("pause_keep", "resume", "pause_abort", "resume_after_abort", "reset_prefix_cache"):
        ok(skyrl, name)
    assert ok(skyrl, "reset_prefix_cache")[server.url]["body"] == {"success": True}
    for name in ("weight_sync.reset_prefix_cache", "weight_sync.pause_generation", "weight_sync.resume_generation"):
        assert ok(skyrl, name) is None
    assert httpx.get(server.url + "/is_paused", timeout=30).json() == {"is_paused": False}


def test_skyrl_gpu_and_private_routes_are_refused(skyrl: dict[str, Any]) -> None:
    """vLLM's sleep/wake (GPU memory) and SkyRL's own server's routes are not served; vLLM's NCCL weight transfer
    needs a GPU."""
    for name in ("sleep", "wake_up", "fetch_weights", "load_lora_adapter"):
        failed(skyrl, name, "404")
    for name in ("weight_sync.init_weight_transfer_engine", "weight_sync.start_weight_update",
                 "weight_sync.finish_weight_update"):
        failed(skyrl, name, "[501]", "needs a GPU")


# ------------------------------------------------------------------------------------------------ on a LoRA server

ADAPTER = "teacher"  # targets q_proj and lm_head: vLLM's LoRA LM head computes the prompt logprobs


@pytest.fixture(scope="module")
def lora_server(lora_tito: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The shared LoRA server with a teacher adapter loaded; yields it with the adapter's transformers + PEFT
    reference and the base model's."""
    from safetensors.torch import load_file

    from tests.reference import PeftReference
    from tests.test_lora import make_weights, write_adapter

    model_dir = Path(httpx.get(lora_tito.url + "/server_info", timeout=30).json()["model"]["path"])
    weights = make_weights(load_file(str(model_dir / "model.safetensors")), seed=5, targets=("q_proj", "lm_head"))
    path = write_adapter(tmp_path_factory.mktemp("teacher") / ADAPTER, weights)
    r = httpx.post(lora_tito.url + "/load_lora_adapter", json={"lora_name": ADAPTER, "lora_path": str(path)},
                   timeout=120)
    assert r.status_code == 200, r.text
    try:
        yield lora_tito, PeftReference(model_dir, path), PeftReference(model_dir, None)
    finally:
        httpx.post(lora_tito.url + "/v1/unload_lora_adapter", json={"lora_name": ADAPTER}, timeout=120)
        restore_server(lora_tito.url)


@pytest.fixture(scope="module")
def lora_drivers(lora_server: Any) -> dict[str, _Driver | str]:
    """Both clients' scoring calls against the LoRA server, side by side (so their requests share engine steps)."""
    url = lora_server[0].url
    out: dict[str, _Driver | str] = {}
    out["trl"] = (_Driver(sys.executable, "trl_driver.py", url, ADAPTER) if importlib.util.find_spec("trl")
                  else "trl is not installed (make test installs the test extra)")
    py = _trainers_python()
    out["skyrl"] = py if isinstance(py, str) else _Driver(py, "skyrl_driver.py", url, ADAPTER, "score")
    running = [d for d in out.values() if isinstance(d, _Driver)]
    for d in running:
        d.wait_ready()
    for d in running:
        d.finish()
    return out


def test_trl_teacher_logprobs_on_a_lora_server(lora_drivers: dict[str, _Driver | str], lora_server: Any,
                                               server: ServerProcess) -> None:
    """TRL's get_sequence_logprobs on a LoRA server (refused with a 400 before): by the base model, equal to the server
    without LoRA; by the adapter, equal to transformers + PEFT on the same adapter."""
    trl = _report(lora_drivers, "trl")
    lora, teacher, base = lora_server
    seq, start = [1, 2, 3, 4, 5, 6, 7, 8], 4
    plain = token_api(server.url, seq, max_tokens=1, temperature=1.0, prompt_logprobs=3)["prompt_logprobs"]
    for name, ref in (("get_sequence_logprobs", base), ("get_sequence_logprobs.adapter", teacher)):
        out = ok(trl, name)
        want = ref.prompt_logprobs(seq)
        for j, pos in enumerate(range(start, len(seq))):
            assert out["actual_token_ids"][0][j] == [seq[pos]]
            assert out["actual_logprobs"][0][j][0] == pytest.approx(want[pos - 1], abs=TOL), (name, pos)
            if ref is base:
                top = {int(t): v["logprob"] for t, v in plain[pos].items()}
                got = {t: lp for t, lp in zip(out["logprob_token_ids"][0][j], out["logprobs"][0][j], strict=True)
                       if lp != float("-inf")}
                assert_close(got, dict(sorted(top.items(), key=lambda kv: -kv[1])[:3]))
    # The adapter's answer is its own: far from the base model's.
    assert abs(ok(trl, "get_sequence_logprobs.adapter")["actual_logprobs"][0][0][0]
               - ok(trl, "get_sequence_logprobs")["actual_logprobs"][0][0][0]) > 100 * TOL


def test_skyrl_sample_with_prompt_logprobs_on_a_lora_server(lora_drivers: dict[str, _Driver | str],
                                                             lora_server: Any) -> None:
    """SkyRL's Tinker sample(include_prompt_logprobs) by the adapter's name (refused with a 400 before): the token
    API's answer for that adapter, and its prompt logprobs those of transformers + PEFT."""
    skyrl = _report(lora_drivers, "skyrl")
    lora, teacher, _ = lora_server
    out = ok(skyrl, "sample")
    prompt = [1, 2, 3, 4, 5]
    r = httpx.post(lora.url + GEN, timeout=120, json={"model": ADAPTER, "token_ids": prompt, "sampling_params": {
        "n": 2, "logprobs": 0, "prompt_logprobs": 2, "temperature": 1.0, "max_tokens": 6, "seed": 42}})
    assert r.status_code == 200, r.text
    ref = r.json()
    assert [s["tokens"] for s in out["sequences"]] == [c["token_ids"] for c in ref["choices"]]
    assert out["prompt_logprobs"][0] is None
    assert out["prompt_logprobs"][1:] == pytest.approx(teacher.prompt_logprobs(prompt), abs=TOL)
    assert all(len(top) == 2 for top in out["topk_prompt_logprobs"][1:])


def test_prime_rl_teacher_scoring_on_a_lora_server(lora_server: Any) -> None:
    """Prime-RL's prefill scoring (client.py ``prefill_logprobs``, on-policy distillation) with the teacher adapter:
    ``prompt_logprobs: 1`` on /inference/v1/generate; ``prompt_logprobs[i]`` is read by token id."""
    lora, teacher, base = lora_server
    seq = [(i * 13) % 400 + 7 for i in range(40)]
    for model, ref in ((ADAPTER, teacher), (None, base)):
        # routed_experts_prompt_start: what Prime-RL adds on a multi-turn bridged prompt (served without MoE too).
        body: dict[str, Any] = {"token_ids": seq, "sampling_params": {
            "max_tokens": 1, "temperature": 1.0, "top_p": 1.0, "prompt_logprobs": 1, "routed_experts_prompt_start": 3}}
        if model:
            body["model"] = model
        r = httpx.post(lora.url + GEN, json=body, timeout=120)
        assert r.status_code == 200, r.text
        plp = r.json()["prompt_logprobs"]
        assert plp[0] is None and len(plp) == len(seq)
        got = [plp[i][str(t)]["logprob"] for i, t in enumerate(seq) if i]
        assert got == pytest.approx(ref.prompt_logprobs(seq), abs=TOL), model
        assert r.json()["choices"][0]["routed_experts"] is None  # not started with --enable-return-routed-experts
