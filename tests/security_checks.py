"""What the security tests share (tests/test_security_*.py, tests/test_http_bytes.py): the real app without an engine,
the key checks' expected answers, a pickle that would run a command, hostile numbers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from starlette.testclient import TestClient

from app.core.settings import Settings
from tests.conftest import ADMIN_KEY, DATA_KEY
from tito.main import create_app

GEN = "/inference/v1/generate"
GOLDEN = Path(__file__).parent / "golden" / "http_bytes.json"  # the generate route's pinned answers
OK_GEN = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2, "temperature": 0}}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def app_with(**settings: Any) -> TestClient:
    """The real app (every router, every middleware) without starting an engine: routes that need the engine
    answer 503 "server is starting", which is enough to see whether the key check let the request through."""
    return TestClient(create_app(Settings.build(env={}, **settings)), raise_server_exceptions=False)


def assert_past_keys(r: httpx.Response) -> None:
    """Let through by the key check: the route itself answered, here without an engine (``app_with``) its 503."""
    assert r.status_code == 503, (r.status_code, r.text)
    assert r.json() == {"error": {"message": "server is starting", "type": "ServiceUnavailableError", "param": None,
                                  "code": 503}}


def assert_401(r: httpx.Response, words: str | None = None) -> None:
    assert r.status_code == 401, (r.status_code, r.text)
    assert r.headers["www-authenticate"] == "Bearer"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 401
    assert err["type"] == "UnauthorizedError"
    assert DATA_KEY not in r.text and ADMIN_KEY not in r.text
    if words:
        assert words in err["message"], err["message"]


class Evil:
    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.fn, self.args)


HOSTILE_NUMBERS = [
    {"seed": 2**70}, {"seed": -1}, {"seed": -(2**70)}, {"top_k": 2**40}, {"top_k": -5}, {"temperature": 1e308},
    {"temperature": 1e-320}, {"top_p": 1e-320}, {"min_p": 1.0}, {"repetition_penalty": 1e308},
    {"presence_penalty": -1e308}, {"frequency_penalty": 1e308}, {"max_tokens": 2**63}, {"min_tokens": 2**63},
    {"min_tokens": 5, "max_tokens": 2}, {"logit_bias": {"1": 1e308, "2": -1e308}}, {"n": 2**63},
    {"logprobs": 2**63}, {"stream_interval": 0}, {"stream_interval": -1}, {"routed_experts_prompt_start": -1},
    {"extra_args": {"a": [[[[[1]]]]]}}, {"logprob_token_ids": [1] * 2000},
]
HOSTILE_RAW = [b'{"token_ids":[1,2],"sampling_params":{"temperature":NaN}}',
               b'{"token_ids":[1,2],"sampling_params":{"top_p":Infinity}}',
               b'{"token_ids":[1,2],"sampling_params":{"logit_bias":{"1":NaN}}}',
               b'{"token_ids":[1,2],"priority":99999999999999999999999}',
               b'{"token_ids":[' + b"[" * 5000 + b"]" * 5000 + b"]}",
               b'{"token_ids":[1],"sampling_params":{"extra_args":' + b'{"a":' * 3000 + b"1" + b"}" * 3001 + b"}"]
