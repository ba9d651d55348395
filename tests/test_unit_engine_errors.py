"""Fast test (no engine): vLLM's own exception classes through the one mapping (app/engine/errors.py), and what every
surface answers for them (``AppState.engine_error``; vLLM's OpenAI routes: ``vllm_error_response``)."""

from __future__ import annotations

import asyncio

import pytest
from vllm.exceptions import VLLMNotFoundError, VLLMServerError, VLLMValidationError
from vllm.v1.engine.exceptions import EngineDeadError

from app.engine.errors import EngineDead, EngineRejected, translate, vllm_error_response


@pytest.mark.parametrize(("raised", "errored", "refused", "kind", "message", "parameter"), [
    (EngineDeadError(), False, False, EngineDead, None, None),
    (RuntimeError("boom"), True, False, EngineDead, "boom", None),  # any failure of a dead engine
    (VLLMValidationError("top_k too large", parameter="top_k"), False, False, EngineRejected,
     "top_k too large (parameter=top_k)", "top_k"),
    (ValueError("Call to add_lora method failed: no lm_head"), False, False, EngineRejected, "no lm_head", None),
    (RuntimeError("Call to add_lora method failed: bad rank"), False, True, EngineRejected, "bad rank", None),
    (OverflowError("int too big"), False, False, EngineRejected, "int too big", None),
    (RuntimeError("boom"), False, False, RuntimeError, "boom", None),  # the server's own failure: as it is
    (TimeoutError(), True, True, TimeoutError, "", None),  # a timeout stays a timeout, even on a dead engine
])
def test_translate(raised: BaseException, errored: bool, refused: bool, kind: type, message: str | None,
                   parameter: str | None) -> None:
    out = translate(raised, errored=errored, refused=refused)
    assert type(out) is kind
    if message is not None:
        assert str(out) == message
    assert getattr(out, "parameter", None) == parameter


def test_a_cancellation_is_never_translated() -> None:
    e = asyncio.CancelledError()
    assert translate(e, errored=True, refused=True) is e


@pytest.mark.parametrize(("raised", "status", "param"), [
    (VLLMValidationError("bad n", parameter="n"), 400, "n"),
    (VLLMNotFoundError("no such model"), 404, None),
    (ValueError("bad"), 400, None),
    (NotImplementedError("beam search"), 501, None),
    (VLLMServerError("kaput"), 500, None),
])
def test_vllms_own_answers_on_its_routes(raised: Exception, status: int, param: str | None) -> None:
    answer = vllm_error_response(raised)
    assert answer is not None and (answer.error.code, answer.error.param) == (status, param)


@pytest.mark.parametrize("raised", [EngineDeadError(), EngineDead("gone"), RuntimeError("boom"), KeyError("k")])
def test_a_dead_engine_and_the_servers_own_failures_are_titos_to_answer(raised: Exception) -> None:
    assert vllm_error_response(raised) is None
