"""Fuzzing: schemathesis generates requests from tito's own OpenAPI schema for every route and sends them to a real
server. Valid (positive) and schema-violating (negative) inputs, without and with the admin key. The bar: no answer
is a server error, and the engine still serves afterwards.

Bounded (``EXAMPLES`` per operation and mode, derandomized so CI sees the same cases every run) to stay within a few
minutes on a 2-core machine. Routes that would make the server connect to an address taken from the request
(``/init_broadcaster``) are not fuzzed with the admin key: a generated host could be any address on the network.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from app.server.security import Plane, classify
from tests.conftest import FUZZ_ADMIN_KEY as ADMIN_KEY
from tests.helpers import ServerProcess, restore_server

pytestmark = pytest.mark.engine

EXAMPLES = 40
GENERATE = "/inference/v1/generate"
GENERATE_EXAMPLES = 200
# vLLM's completions route (its own handler, behind tito's checks): prompt ids folded into the vocabulary too.
FOLDED = {"/v1/completions": 60}
# Never fuzzed with the admin key: the body names a host the server's workers would connect to.
NETWORK_ROUTES = {"/init_broadcaster", "/areal_init_weights_update_group"}
# State the admin pass may change; put back after every such call so later cases (and generate) are served.
RESTORE = {"/pause": ("POST", "/resume"), "/areal_pause_generation": ("POST", "/resume"),
           "/drain": ("DELETE", "/drain")}
# The only 5xx answers that are not faults, each deliberate and named by its message:
# 501 for vLLM's GPU weight-transfer engine on a CPU server; 504 when a timeout the *request* set has elapsed
# (e.g. /pause?timeout=1e-300); the operation continues on the server.
DELIBERATE_5XX = {501: ("needs a GPU", "not supported"), 504: ("did not finish within",)}


@pytest.fixture(scope="module")
def fuzzed(fuzz_tito: ServerProcess) -> Iterator[ServerProcess]:
    """The shared fuzzing server (conftest.py: the admin key alone, LoRA, small caps: at most 4 sequences of at most
    64 tokens). Put back at the end (test_lifecycle.py's second-signal test ends it after this module)."""
    yield fuzz_tito
    restore_server(fuzz_tito.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"})


@pytest.fixture(scope="module")
def schema(fuzzed: ServerProcess) -> Any:
    return schemathesis.openapi.from_url(fuzzed.url + "/openapi.json")


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    return {"status": Counter(), "failures": [], "cases": 0, "per_route": Counter(), "seconds": Counter()}


def _operations(schema: Any) -> list[Any]:
    ops = [r.ok() for r in schema.get_all_operations()]
    assert ops, "the schema has no operations"
    return ops


def _run(schema: Any, base_url: str, results: dict[str, Any], headers: dict[str, str],
         keep: Callable[[str], bool], label: str) -> None:
    session = requests.Session()
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    for op in _operations(schema):
        if keep(op.path):
            t0 = time.monotonic()
            _fuzz_one(op, session, base_url, results, headers, admin, label)
            results["seconds"][f"{op.method.upper()} {op.path}"] += time.monotonic() - t0


def _ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def _in_vocab(case: Any) -> Any:
    """Fold generated prompt ids into the tiny model's vocabulary (512), so the engine, not only the id check,
    meets the generated sampling parameters (the token API's ``token_ids``; /v1/completions' ``prompt``, one list
    of ids or several)."""
    body = case.body
    if not isinstance(body, dict):
        return case
    if _ids(body.get("token_ids")):
        body["token_ids"] = [abs(t) % 512 for t in body["token_ids"][:48]]
    prompt = body.get("prompt")
    if _ids(prompt):
        body["prompt"] = [abs(t) % 512 for t in prompt[:48]]
    elif isinstance(prompt, list) and prompt and all(_ids(p) for p in prompt):
        body["prompt"] = [[abs(t) % 512 for t in p[:48]] for p in prompt[:4]]
    return case


# Several admin routes parse their JSON body themselves and publish no body schema; they get JSON objects built from
# the keys any of them reads, with values of every JSON type, so their own validation is fuzzed as well.
BODY_KEYS = ("weight_dir", "weight_version", "timeout", "update_info", "init_info", "new_version", "request_ids",
             "lora_name", "lora_path", "load_inplace", "mode", "reset_running_requests", "reset_external")
# Finite floats only: the HTTP client itself cannot encode NaN/Infinity as JSON (raw non-finite bodies are sent in
# tests/test_security_e2e.py).
_SCALARS = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
            | st.text(max_size=20))
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                           max_size=3), max_leaves=6)
SCHEMALESS_BODIES = st.one_of(st.dictionaries(st.sampled_from(BODY_KEYS) | st.text(max_size=8), _JSON, max_size=4),
                              _JSON)


def _fuzz_schemaless_body(op: Any, session: requests.Session, base_url: str, results: dict[str, Any],
                          headers: dict[str, str], admin: dict[str, str], label: str) -> None:
    name = f"{op.method.upper()} {op.path} (json)"

    @given(body=SCHEMALESS_BODIES)
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def one(body: Any) -> None:
        resp = session.request(op.method.upper(), base_url + op.path, json=body, headers=headers, timeout=60)
        _record(results, name, resp.status_code, resp.text, label, f"body={body!r}")
        _restore(op.path, session, base_url, admin)

    one()


def _record(results: dict[str, Any], name: str, code: int, text: str, label: str, repro: str) -> None:
    results["status"][code] += 1
    results["cases"] += 1
    results["per_route"][name] += 1
    if code >= 500 and not any(w in text for w in DELIBERATE_5XX.get(code, ())):
        results["failures"].append(f"[{label}] {code} {name}: {text[:300]}\n    {repro}")


def _restore(path: str, session: requests.Session, base_url: str, admin: dict[str, str]) -> None:
    if path in RESTORE:
        method, target = RESTORE[path]
        r = session.request(method, base_url + target, headers=admin, timeout=60)
        assert r.status_code == 200, (target, r.text)


def _fuzz_one(op: Any, session: requests.Session, base_url: str, results: dict[str, Any], headers: dict[str, str],
              admin: dict[str, str], label: str) -> None:
    name = f"{op.method.upper()} {op.path}"
    positive = op.as_strategy(generation_mode=schemathesis.GenerationMode.POSITIVE)
    negative = op.as_strategy(generation_mode=schemathesis.GenerationMode.NEGATIVE)
    strategy = st.one_of(positive, negative)
    examples = EXAMPLES
    if op.path == GENERATE:
        strategy = st.one_of(positive, negative, positive.map(_in_vocab))
        examples = GENERATE_EXAMPLES
    elif op.path in FOLDED:
        strategy = st.one_of(positive, negative, positive.map(_in_vocab))
        examples = FOLDED[op.path]

    @given(case=strategy)
    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def one(case: Any) -> None:
        resp = case.call(base_url=base_url, session=session, headers=headers, timeout=60)
        _record(results, name, resp.status_code, resp.text, label, case.as_curl_command(headers=headers))
        _restore(op.path, session, base_url, admin)

    one()
    if headers and op.method.upper() == "POST" and len(op.body) == 0:
        _fuzz_schemaless_body(op, session, base_url, results, headers, admin, label)


def _summary(results: dict[str, Any]) -> str:
    hist = ", ".join(f"{k}: {v}" for k, v in sorted(results["status"].items()))
    slow = ", ".join(f"{k} {v:.1f}s" for k, v in results["seconds"].most_common(4))
    return (f"{results['cases']} cases over {len(results['per_route'])} operations; status histogram {{{hist}}}; "
            f"slowest: {slow}")


def test_fuzz_every_route_without_admin_key(fuzzed, schema, results):
    """Pass 1: every operation, no key. Data and open routes get fuzzed bodies; admin routes must refuse (401)."""
    t0 = time.monotonic()
    before = results["status"][401]
    _run(schema, fuzzed.url, results, {}, lambda p: True, "no key")
    ops = _operations(schema)
    admin_ops = sum(1 for op in ops if classify(op.path) is Plane.ADMIN)
    assert admin_ops > 5 and results["status"][401] - before >= admin_ops
    print(f"\nfuzz pass 1 (no key) in {time.monotonic() - t0:.0f}s: {_summary(results)}")
    assert not results["failures"], "\n".join(results["failures"])


def test_fuzz_admin_routes_with_admin_key(fuzzed, schema, results):
    """Pass 2: admin operations with the key, so their validation is fuzzed too (pause/drain are undone each time)."""
    t0 = time.monotonic()
    n0, before_401 = results["cases"], results["status"][401]
    _run(schema, fuzzed.url, results, {"Authorization": f"Bearer {ADMIN_KEY}"},
         lambda p: classify(p) is Plane.ADMIN and p not in NETWORK_ROUTES, "admin key")
    assert results["cases"] > n0
    assert results["status"][401] == before_401, "the admin key must open every admin route"
    print(f"\nfuzz after pass 2 (admin key) in {time.monotonic() - t0:.0f}s: {_summary(results)}")
    assert not results["failures"], "\n".join(results["failures"])


def test_engine_still_serves_after_fuzzing(fuzzed, results):
    assert results["cases"] > 0
    url = fuzzed.url
    assert httpx.get(url + "/health", timeout=30).json()["status"] == "ok"
    h = {"Authorization": f"Bearer {ADMIN_KEY}"}
    assert httpx.get(url + "/is_paused", headers=h, timeout=30).json()["is_paused"] is False
    assert httpx.get(url + "/drain", headers=h, timeout=30).json()["draining"] is False
    r = httpx.post(url + "/inference/v1/generate", timeout=60,
                   json={"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4, "temperature": 0}})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["token_ids"]) == 4
    # main.py's catch-all logs "unhandled error" for every 500 it turns into an envelope.
    assert "unhandled error" not in fuzzed.log_text(), fuzzed.log_tail()
