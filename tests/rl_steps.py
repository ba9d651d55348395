"""What the weight tests share: checkpoints written as a trainer writes them, the transformers reference answer for
a set of weights, greedy answers, Prime-RL's step (pause, update, resume), and requests running in the background
while an admin call lands (the endless request)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save_file

from app.tiny.model import TINY_CONFIG
from tests.helpers import ServerProcess, metric_value, restore_server

GEN = "/inference/v1/generate"
PROMPTS = [[1, 2, 3, 4, 5], [17, 300, 42, 9]]
# max_tokens of a request that must still be running when an admin call lands. No length is long enough on a busy
# 2-core machine, where the test process can be descheduled for seconds while the engine generates, so such a request
# is endless: it cannot finish within a test on any machine (~1500 tokens/s at most here) and the test ends it itself
# with /abort_requests or /pause?mode=abort, never by waiting for it. The shared long-context server's context fits
# it (a prompt of a few tokens + ENDLESS); its KV cache (~1 KiB per token for the tiny model, 1 GiB) holds it ~17 times.
ENDLESS = 60000

def write_step(directory: Path, sd: dict[str, torch.Tensor], *, config: bool | dict[str, Any] = False,
               shards: int = 1) -> Path:
    """Write ``sd`` as a trainer does: model.safetensors, or shards + index; no config.json unless asked (``True``:
    the tiny model's, or the config given)."""
    directory.mkdir(parents=True, exist_ok=True)
    if shards == 1:
        save_file(sd, str(directory / "model.safetensors"))
    else:
        names = sorted(sd)
        weight_map = {}
        for i in range(shards):
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: sd[k] for k in names[i::shards]}
            save_file(part, str(directory / fname))
            weight_map.update({k: fname for k in part})
        (directory / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in sd.values())},
             "weight_map": weight_map}))
    if config:
        (directory / "config.json").write_text(json.dumps(TINY_CONFIG if config is True else config))
    return directory


def reference_greedy(sd: dict[str, torch.Tensor], directory: Path, prompts: list[list[int]], n: int,
                     config: dict[str, Any] | None = None) -> list:
    """transformers greedy on ``sd`` (fp32) with ``config`` (default: the tiny model's): the independent answer for "a
    fresh engine on these weights"."""
    from tests.reference import Reference

    write_step(directory, {k: v.float() for k, v in sd.items()}, config=config or True)
    ref = Reference(directory)
    return [ref.greedy(p, n)[0] for p in prompts]


def greedy(client: httpx.Client, prompts: list[list[int]] = PROMPTS, n: int = 8) -> list[list[int]]:
    out = []
    for p in prompts:
        r = client.post(GEN, json={"token_ids": p, "sampling_params": {"max_tokens": n, "temperature": 0}})
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["token_ids"])
    return out


def update(client: httpx.Client, directory: Path | str | None, **kw: object) -> httpx.Response:
    return client.post("/update_weights", json={"weight_dir": None if directory is None else str(directory), **kw})


def rl_step(client: httpx.Client, directory: Path, mode: str = "keep", **kw: object) -> dict:
    """What Prime-RL's orchestrator does per step: pause, update, resume (in finally)."""
    assert client.post("/pause", params={"mode": mode, "clear_cache": "false"}).json() == {"status": "paused"}
    try:
        r = update(client, directory, **kw)
        assert r.status_code == 200, r.text
        return r.json()
    finally:
        assert client.post("/resume").json() == {"status": "resumed"}


class Background:
    """Run a blocking call in a thread; ``result()`` joins it."""

    def __init__(self, fn, *args, **kw) -> None:  # noqa: ANN001
        self.value: object = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.value = fn(*args, **kw)
            except BaseException as e:  # noqa: BLE001
                self.error = e

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def done(self) -> bool:
        return not self.thread.is_alive()

    def result(self, timeout: float = 120.0) -> object:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "background call did not finish"
        if self.error:
            raise self.error
        return self.value


def long_request(url: str, max_tokens: int, prompt: list[int] | None = None, stream: bool = False,
                 tokens: list[int] | None = None, request_id: str | None = None) -> dict:
    """A greedy request, plain JSON or streamed; a stream appends its tokens to ``tokens`` as they arrive."""
    body: dict = {"token_ids": prompt or [5, 6, 7], "sampling_params": {"max_tokens": max_tokens, "temperature": 0,
                                                                         "ignore_eos": True}}
    if request_id is not None:
        body["request_id"] = request_id
    with httpx.Client(base_url=url, timeout=300) as c:
        if not stream:
            r = c.post(GEN, json=body)
            assert r.status_code == 200, r.text
            return r.json()
        toks = tokens if tokens is not None else []
        spans = finish = None
        with c.stream("POST", GEN, json={**body, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                assert "error" not in ev, ev
                for ch in ev["choices"]:
                    toks.extend(ch["token_ids"])
                    spans = ch["weight_versions"] or spans
                    finish = ch["finish_reason"] or finish
        return {"choices": [{"token_ids": list(toks), "weight_versions": spans, "finish_reason": finish}]}


class Endless(Background):
    """An endless greedy request (``ENDLESS`` tokens) in a thread; the test ends it with ``abort()`` (or a pause in
    abort mode), and ``result()`` is then its answer: partial tokens, ``finish_reason: "abort"``."""

    def __init__(self, url: str, request_id: str, prompt: list[int] | None = None, stream: bool = True) -> None:
        self.url = url
        self.request_id = request_id
        self.tokens: list[int] = []  # a stream's tokens so far, appended by the request thread
        super().__init__(long_request, url, ENDLESS, prompt, stream, self.tokens, request_id)

    def abort(self, client: httpx.Client) -> None:
        r = client.post("/abort_requests", json={"request_ids": [self.request_id]})
        assert r.json() == {"status": "aborted", "aborted": 1}, r.text

    def wait_tokens(self, n: int, timeout: float = 120.0) -> None:
        """Wait until the stream's client has received more than ``n`` tokens."""
        deadline = time.monotonic() + timeout
        while len(self.tokens) <= n:
            assert time.monotonic() < deadline, f"the stream has {len(self.tokens)} tokens, not more than {n}"
            assert not self.done(), f"the endless request ended: {self.error!r} {self.value!r}"[:600]
            time.sleep(0.01)


def start_endless(client: httpx.Client, url: str, request_id: str, prompt: list[int] | None = None,
                  stream: bool = True) -> Endless:
    """Start an endless request and return once it has generated tokens, so it surely is in the engine: a stream's
    client has received some, or (plain JSON) the server's count of generated tokens went up. The latter assumes
    nothing else generates on that server meanwhile."""
    before = generated_tokens(client)
    bg = Endless(url, request_id, prompt, stream)
    if stream:
        bg.wait_tokens(0)
        return bg
    deadline = time.monotonic() + 120
    while generated_tokens(client) <= before:
        assert time.monotonic() < deadline, "the endless request never generated"
        assert not bg.done(), f"the endless request ended: {bg.error!r} {bg.value!r}"[:600]
        time.sleep(0.05)
    return bg


def generated_tokens(client: httpx.Client) -> float:
    """Tokens the engine has generated so far (all requests), as the server counts them."""
    return metric_value(client.get("/metrics").text, "vllm:generation_tokens_total") or 0.0


def weight_module_fixtures(name: str = "weights", timeout: float = 120.0) -> tuple[Any, Any, Any]:
    """``root, server, client = weight_module_fixtures()``: the module fixtures of the modules that change weights on
    the shared long-context server (test_weights.py, test_weights_pause.py, test_broadcast.py): ``root``, a directory
    ``name`` for their checkpoints; ``server``, the tiny model's weights and a context for the endless requests,
    nothing else running on it during the module, which puts it back at the end (base weights, resumed, no broadcast
    group); ``client``, with ``timeout``."""

    @pytest.fixture(scope="module")
    def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
        return tmp_path_factory.mktemp(name)

    @pytest.fixture(scope="module")
    def server(long_tito: ServerProcess) -> Iterator[ServerProcess]:
        yield long_tito
        restore_server(long_tito.url, drop_broadcaster=True)

    @pytest.fixture(scope="module")
    def client(server: ServerProcess) -> Iterator[httpx.Client]:
        with httpx.Client(base_url=server.url, timeout=timeout) as c:
            yield c

    return root, server, client
