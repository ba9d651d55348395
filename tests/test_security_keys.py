"""API keys per plane (data, admin, open): default-deny classification of every route, the key rules on the real app
(real route table and middleware, no engine), keys from the environment, the middleware on its own. The end-to-end
checks on a real server are in test_security_e2e.py."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from app.core.settings import Settings
from app.server.security import Keys, Plane, classify
from tests.conftest import ADMIN_KEY, DATA_KEY
from tests.security_checks import (
    GEN,
    OK_GEN,
    app_with,
    assert_401,
    assert_past_keys,
    bearer,
)
from tito.main import create_app

# --------------------------------------------------------------------------------------------------- planes


@pytest.mark.parametrize("path,plane", [
    ("/health", Plane.OPEN), ("/liveness", Plane.OPEN), ("/ready", Plane.OPEN), ("/version", Plane.OPEN),
    ("/metrics", Plane.OPEN), ("/openapi.json", Plane.OPEN), ("/docs", Plane.OPEN), ("/redoc", Plane.OPEN),
    (GEN, Plane.DATA), ("/v1/models", Plane.DATA), ("/v1/lora_adapters", Plane.ADMIN),
    ("/v1/load_lora_adapter", Plane.ADMIN), ("/v1/load_lora_adapter/", Plane.ADMIN),
    ("/v1/unload_lora_adapter", Plane.ADMIN), ("/inference/v1/abort_requests", Plane.ADMIN),
    ("/load_lora_adapter", Plane.ADMIN), ("/pause", Plane.ADMIN), ("/resume", Plane.ADMIN),
    ("/update_weights", Plane.ADMIN), ("/init_broadcaster", Plane.ADMIN), ("/drain", Plane.ADMIN),
    ("/abort_requests", Plane.ADMIN), ("/sleep", Plane.ADMIN), ("/some_route_added_later", Plane.ADMIN),
    ("/v1", Plane.ADMIN), ("/inference", Plane.ADMIN), ("/healthz", Plane.ADMIN), ("/health/", Plane.ADMIN),
    ("", Plane.ADMIN),
])
def test_classify_is_default_deny(path, plane):
    assert classify(path) is plane


def test_protect_metrics_moves_metrics_to_the_data_plane():
    assert classify("/metrics", protect_metrics=True) is Plane.DATA


ADMIN_WORDS = ("pause", "resume", "weight", "broadcast", "load_lora", "unload_lora", "drain", "abort", "sleep",
               "wake", "reset", "collective", "shutdown", "transfer", "stage", "commit")


def test_every_mounted_route_has_the_intended_plane():
    """Guard for routes other issues add: anything that changes state is admin, whatever its prefix."""
    app = create_app(Settings.build(env={}))
    paths = {r.path for r in app.routes if hasattr(r, "path")}
    assert {"/inference/v1/generate", "/pause", "/update_weights", "/load_lora_adapter"} <= paths
    for path in paths:
        plane = classify(path)
        if any(w in path for w in ADMIN_WORDS) and path != "/drain_status":
            assert plane is Plane.ADMIN, path
        if plane is Plane.OPEN:
            assert path in {"/health", "/liveness", "/ready", "/version", "/metrics", "/openapi.json", "/docs",
                            "/docs/oauth2-redirect", "/redoc"}, path


def test_keys_empty_means_none():
    assert not Keys.of(None, None).any
    assert not Keys.of("EMPTY", "").any
    k = Keys.of("a", None)
    assert k.data == k.admin and not k.admin_is_separate
    k = Keys.of(None, "b")
    assert k.data is None and k.admin is not None


# --------------------------------------------------------------------------------------------------- key rules


@pytest.fixture(scope="module")
def both() -> TestClient:
    return app_with(api_key=DATA_KEY, admin_api_key=ADMIN_KEY)


def test_data_route_missing_wrong_and_right_key(both):
    assert_401(both.post(GEN, json=OK_GEN), "Authorization: Bearer")
    assert_401(both.post(GEN, json=OK_GEN, headers=bearer("nope")), "invalid API key")
    assert_401(both.post(GEN, json=OK_GEN, headers=bearer("EMPTY")), "invalid API key")
    assert_401(both.post(GEN, json=OK_GEN, headers={"Authorization": DATA_KEY}))  # no scheme
    assert_401(both.post(GEN, json=OK_GEN, headers={"Authorization": f"Basic {DATA_KEY}"}))
    assert_401(both.post(GEN, json=OK_GEN, headers=bearer(DATA_KEY + "x")))
    assert_401(both.post(GEN, json=OK_GEN, headers=bearer(DATA_KEY[:-1])))
    assert_401(both.get("/v1/models"))
    for headers in (bearer(DATA_KEY), bearer(ADMIN_KEY), {"Authorization": f"bearer  {DATA_KEY} "}):
        r = both.post(GEN, json=OK_GEN, headers=headers)
        assert r.status_code == 503 and "starting" in r.text, r.text  # past the key check, no engine here
        assert both.get("/v1/models", headers=headers).status_code == 503


@pytest.mark.parametrize("method,path", [
    ("POST", "/pause"), ("POST", "/resume"), ("POST", "/update_weights"), ("POST", "/reload_weights"),
    ("POST", "/init_broadcaster"), ("POST", "/load_lora_adapter"), ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/unload_lora_adapter"), ("POST", "/drain"), ("DELETE", "/drain"), ("POST", "/abort_requests"),
    ("POST", "/inference/v1/abort_requests"), ("GET", "/is_paused"), ("POST", "/update_weight_version"),
    ("POST", "/stage"), ("POST", "/stage_chunk"), ("POST", "/stage_stream_init"), ("POST", "/stage_stream_chunk"),
    ("POST", "/commit"), ("GET", "/weight_status"),
])
def test_admin_route_needs_the_admin_key(both, method, path):
    body = {"lora_name": "a", "lora_path": "/tmp"} if "lora" in path else {}
    assert_401(both.request(method, path, json=body), "Authorization: Bearer")
    assert_401(both.request(method, path, json=body, headers=bearer("wrong")), "invalid API key")
    assert_401(both.request(method, path, json=body, headers=bearer(DATA_KEY)), "data-plane API key does not open")
    assert_past_keys(both.request(method, path, json=body, headers=bearer(ADMIN_KEY)))


def test_unknown_routes_are_admin_so_404_needs_a_key(both):
    assert_401(both.get("/no/such/route"))
    assert_401(both.get("/no/such/route", headers=bearer(DATA_KEY)))
    assert both.get("/no/such/route", headers=bearer(ADMIN_KEY)).status_code == 404


def test_encoded_and_slashed_admin_paths_stay_admin(both):
    for path in ("/v1/load%5Flora_adapter", "/v1/load_lora_adapter/", "/inference/v1/abort%5Frequests"):
        assert_401(both.post(path, json={}, headers=bearer(DATA_KEY)))


def test_open_routes_need_no_key(both):
    assert both.get("/version").status_code == 200
    assert both.get("/openapi.json").status_code == 200
    assert both.get("/docs").status_code == 200
    # The probes answer for the starting server (no engine here); the metrics are served.
    assert (both.get("/health").status_code, both.get("/health").json()) == (503, {"status": "starting"})
    assert both.get("/liveness").status_code == 503 and both.get("/liveness").json()["status"] == "starting"
    assert (both.get("/ready").status_code, both.get("/ready").json()) == (503, {"status": "not_ready",
                                                                                "reason": "starting"})
    r = both.get("/metrics")
    assert r.status_code == 200 and "tito_requests_total" in r.text


def test_protect_metrics():
    c = app_with(api_key=DATA_KEY, admin_api_key=ADMIN_KEY, protect_metrics=True)
    assert_401(c.get("/metrics"))
    r = c.get("/metrics", headers=bearer(DATA_KEY))
    assert r.status_code == 200 and "tito_requests_total" in r.text
    assert c.get("/health").json() == {"status": "starting"}  # still open


def test_only_api_key_guards_both_planes_with_that_key():
    c = app_with(api_key=DATA_KEY)
    assert_401(c.post("/pause"))
    assert_401(c.post(GEN, json=OK_GEN))
    assert_past_keys(c.post("/pause", headers=bearer(DATA_KEY)))
    assert_past_keys(c.post(GEN, json=OK_GEN, headers=bearer(DATA_KEY)))


def test_only_admin_key_leaves_the_data_plane_open():
    c = app_with(admin_api_key=ADMIN_KEY)
    assert_past_keys(c.post(GEN, json=OK_GEN))
    assert_401(c.post("/pause"))
    assert_past_keys(c.post("/pause", headers=bearer(ADMIN_KEY)))


@pytest.mark.parametrize("key", [None, "", "EMPTY"])
def test_no_key_configured_means_open(key):
    c = app_with(api_key=key, admin_api_key=key)
    assert_past_keys(c.post("/pause"))
    assert_past_keys(c.post(GEN, json=OK_GEN, headers=bearer("anything")))


def test_keys_come_from_the_environment_and_stay_out_of_repr():
    s = Settings.build(env={"TITO_API_KEY": DATA_KEY, "TITO_ADMIN_API_KEY": ADMIN_KEY})
    assert (s.api_key, s.admin_api_key) == ([DATA_KEY], ADMIN_KEY)
    assert DATA_KEY not in repr(s) and ADMIN_KEY not in repr(s)
    c = TestClient(create_app(s))
    assert_401(c.post("/pause", headers=bearer(DATA_KEY)))


def test_unauthenticated_body_is_refused_before_it_is_read(both):
    # 401, not 413: a caller without a key gets nothing past the key check, not even the body limit.
    r = both.post(GEN, content=b"x" * (9 * 1024 * 1024), headers={"Content-Type": "application/json"})
    assert_401(r)


# A tiny app is also enough to show the middleware needs nothing else from tito.
def test_middleware_is_standalone():
    from app.server.security import ApiKeyAuth

    app = FastAPI()

    @app.post("/pause")
    async def pause() -> dict[str, str]:
        return {"status": "paused"}

    app.add_middleware(ApiKeyAuth, keys=Keys.of(DATA_KEY, ADMIN_KEY))
    c = TestClient(app)
    assert_401(c.post("/pause", headers=bearer(DATA_KEY)))
    assert c.post("/pause", headers=bearer(ADMIN_KEY)).json() == {"status": "paused"}
