"""gRPC keys and health states, on tito's real gRPC server (``app/grpc/server.py``) over a stand-in state (no engine:
the key check and the health answers read nothing else). With ``--api-key`` every VllmEngine call needs
``authorization: Bearer <key>``; health, the engine's HealthCheck and reflection stay open."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc

from app.core.protocol import ApiError
from app.core.settings import Settings
from app.grpc.server import ENGINE_SERVICE, GrpcServer
from tests.helpers import free_port

KEY = "grpc-key"
ADMIN = "grpc-admin-key"


class StandInState:
    """What the gRPC server reads before the engine: settings, readiness, admission."""

    def __init__(self, **settings: Any) -> None:
        self.settings = Settings(host="127.0.0.1", grpc_port=free_port(), **settings)
        self.not_ready_reason: str | None = None

    def admit(self) -> None:
        raise ApiError(503, "server is draining; send the request to another replica.")

    def changed(self) -> None:
        """What a control call ends with (one API process: nothing to publish)."""


@pytest.fixture
async def served(request: pytest.FixtureRequest) -> AsyncIterator[tuple[StandInState, grpc.aio.Channel]]:
    state = StandInState(**getattr(request, "param", {"api_key": KEY}))
    server = GrpcServer(state)  # type: ignore[arg-type]
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{state.settings.grpc_port}")
    try:
        yield state, channel
    finally:
        await channel.close()
        await server.stop(0)


async def _code(call: Any) -> tuple[grpc.StatusCode, str]:
    try:
        res = call
        if hasattr(res, "__aiter__"):
            async for _ in res:
                pass
        else:
            await res
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def _gen() -> pb.GenerateRequest:
    return pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[1, 2]),
                              sampling_params=pb.SamplingParams(max_tokens=2))


async def test_engine_calls_need_the_key(served: tuple[StandInState, grpc.aio.Channel]) -> None:
    _, channel = served
    stub = pb_grpc.VllmEngineStub(channel)
    for md in (None, (("authorization", "Bearer wrong"),), (("authorization", f"Basic {KEY}"),)):
        code, details = await _code(stub.Generate(_gen(), metadata=md))
        assert code is grpc.StatusCode.UNAUTHENTICATED, (md, details)
        assert "API key" in details
        code, _ = await _code(stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md))
        assert code is grpc.StatusCode.UNAUTHENTICATED
        code, _ = await _code(stub.Abort(pb.AbortRequest(request_ids=["x"]), metadata=md))
        assert code is grpc.StatusCode.UNAUTHENTICATED
    # With the key the call reaches tito's admission (here: draining → UNAVAILABLE with HTTP's 503 message).
    code, details = await _code(stub.Generate(_gen(), metadata=(("authorization", f"Bearer {KEY}"),)))
    assert code is grpc.StatusCode.UNAVAILABLE and "draining" in details


@pytest.mark.parametrize("served", [{"api_key": KEY, "admin_api_key": ADMIN}], indirect=True)
async def test_the_admin_key_opens_engine_calls_too(served: tuple[StandInState, grpc.aio.Channel]) -> None:
    _, channel = served
    stub = pb_grpc.VllmEngineStub(channel)
    for key in (KEY, ADMIN):
        code, _ = await _code(stub.Generate(_gen(), metadata=(("authorization", f"Bearer {key}"),)))
        assert code is grpc.StatusCode.UNAVAILABLE


async def test_health_and_reflection_stay_open_and_follow_readiness(
        served: tuple[StandInState, grpc.aio.Channel]) -> None:
    state, channel = served
    stub = pb_grpc.VllmEngineStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    for service in ("", ENGINE_SERVICE):
        assert (await health.Check(health_pb2.HealthCheckRequest(service=service))).status == serving
    assert (await stub.HealthCheck(pb.HealthCheckRequest())).healthy
    code, _ = await _code(health.Check(health_pb2.HealthCheckRequest(service="nope")))
    assert code is grpc.StatusCode.NOT_FOUND
    for reason in ("starting", "draining", "shutting_down"):
        state.not_ready_reason = reason
        assert (await health.Check(health_pb2.HealthCheckRequest())).status == not_serving
        answer = await stub.HealthCheck(pb.HealthCheckRequest())
        assert not answer.healthy and answer.message == reason
    # Watch sends the current status, then each change.
    watch = health.Watch(health_pb2.HealthCheckRequest())
    assert (await watch.read()).status == not_serving
    state.not_ready_reason = None
    assert (await watch.read()).status == serving
    watch.cancel()

    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = refl.ServerReflectionInfo()
    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    answer = await call.read()
    await call.done_writing()
    names = {s.name for s in answer.list_services_response.service}
    assert {ENGINE_SERVICE, "grpc.health.v1.Health"} <= names


@pytest.mark.parametrize("served", [{}], indirect=True)
async def test_no_key_configured_means_open(served: tuple[StandInState, grpc.aio.Channel]) -> None:
    _, channel = served
    code, _ = await _code(pb_grpc.VllmEngineStub(channel).Generate(_gen()))
    assert code is grpc.StatusCode.UNAVAILABLE
