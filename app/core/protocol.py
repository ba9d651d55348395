"""Wire models of vLLM 0.32's token-in/token-out API, and its error envelope.

These are tito's own models (not imports of vLLM's serving internals) so a vLLM upgrade cannot silently change
the wire. Requests are parsed with pydantic; responses are built as plain dicts in ``routers/generate.py`` and
serialized with orjson (no per-token models on the hot path).
"""

from __future__ import annotations

from collections.abc import Sequence
from http import HTTPStatus
from typing import Any, Literal, TypeVar
from urllib.parse import quote

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import Response

GENERATE_PATH = "/inference/v1/generate"  # the token API's route

# --------------------------------------------------------------------------------------------------- errors

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "UnauthorizedError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    413: "RequestEntityTooLargeError",
    415: "UnsupportedMediaTypeError",
    499: "ClientClosedRequest",  # nginx's code: the client went away; nobody reads this answer
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


class ApiError(Exception):
    """An error answered in vLLM's envelope: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,  # noqa: A002 - the envelope's own field name
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _ERROR_TYPES.get(status) or status_phrase(status)
        self.param = param
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, type=self.type, param=self.param)

    def response(self) -> Response:
        return json_response(self.body(), self.status, self.headers)


def header_value(text: str) -> str:
    """``text`` as an HTTP header value: as it is when printable ASCII (every id tito makes from an ASCII client id),
    else percent-encoded. A client's id may hold any character; a header cannot (Starlette raised on it: a 500)."""
    return text if text.isascii() and text.isprintable() else quote(text, safe="")


async def send_api_error(send: Any, err: ApiError) -> None:
    """Send ``err``'s answer straight to an ASGI ``send`` (pure-ASGI code: middleware, the generate route's lean
    path), the same bytes as its ``response()``."""
    resp = err.response()
    await send({"type": "http.response.start", "status": err.status, "headers": resp.raw_headers})
    await send({"type": "http.response.body", "body": resp.body})


def content_length_refusal(value: bytes, limit: int) -> ApiError | None:
    """The answer to a ``Content-Length`` header over the body limit (413) or not a size (400), before any byte of
    the body is read; None when the body may come."""
    try:
        size = int(value)
    except ValueError:
        size = -1
    if 0 <= size <= limit:
        return None
    if size > 0:
        return ApiError(413, f"request body of {size} bytes exceeds the limit of {limit} bytes.")
    return ApiError(400, "invalid Content-Length header.")


def status_phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A JSON answer serialized by orjson."""
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json", headers=headers)


def error_body(status: int, message: str, *, type: str | None = None, param: str | None = None) -> dict[str, Any]:  # noqa: A002
    return {"error": {"message": message, "type": type or _ERROR_TYPES.get(status, "Error"), "param": param,
                      "code": status}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def validation_error(exc: ValidationError, prefix: str = "body") -> ApiError:
    """Pydantic errors → 400 as vLLM words them: type "Bad Request", param = the first bad location."""
    return errors_to_api_error(exc.errors(include_url=False, include_input=False), (prefix,))


M = TypeVar("M", bound=BaseModel)


def parse_json_body(model: type[M], raw: bytes) -> M:
    """``model`` parsed straight from a raw JSON body: not JSON at all -> 400 naming the body, a bad field -> 400
    naming the field, as vLLM words both."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        if any(err["type"] == "json_invalid" for err in e.errors()):
            raise ApiError(400, "request body is not valid JSON.", type="Bad Request", param="body") from None
        raise validation_error(e) from None


def errors_to_api_error(errors: Sequence[Any], prefix: tuple[str, ...] = ()) -> ApiError:
    """Validation errors (pydantic's or FastAPI's dicts with ``loc``/``msg``) → one 400, at most 10 listed."""

    def loc(e: Any) -> str:
        return ".".join(str(x) for x in (*prefix, *e.get("loc", ())))

    parts = [f"{loc(e)}: {e.get('msg', '')}" for e in errors[:10]]
    n = len(errors)
    msg = f"{n} validation error{'s' if n != 1 else ''}: " + "; ".join(parts)
    return ApiError(400, msg, type="Bad Request", param=loc(errors[0]) if errors else None)


# --------------------------------------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class WireSamplingParams(BaseModel):
    """The JSON keys of vLLM's ``SamplingParams`` that make sense without a tokenizer.

    Unknown keys are ignored (real clients send e.g. ``return_token_ids``). ``model_fields_set`` tells which keys the
    client actually sent, so server-side defaults (``max_tokens``) apply only to omitted keys.
    """

    model_config = ConfigDict(extra="ignore")

    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    flat_logprobs: bool | None = None
    detokenize: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    extra_args: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    skip_reading_prefix_cache: bool | None = None
    repetition_detection: dict[str, Any] | None = None
    routed_experts_prompt_start: int | None = None
    stream_interval: int | None = None
    # Not SamplingParams fields, but clients put them here: Prime-RL sends cache_salt inside sampling_params.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    return_token_ids: bool | None = None


class GenerateRequest(BaseModel):
    """Body of ``POST /inference/v1/generate`` (vLLM 0.32 ``GenerateRequest``, tokens mode)."""

    model_config = ConfigDict(extra="ignore")

    token_ids: list[int] = Field(min_length=1, description="Prompt token ids.")
    sampling_params: WireSamplingParams = Field(default_factory=WireSamplingParams)
    request_id: str | None = Field(default=None, max_length=256,
                                   description="Client id; the X-Request-Id header overrides it.")
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    return_token_ids: bool | None = None
    output_mode: Literal["tokens", "text"] = "tokens"
    # Accepted for compatibility with vLLM's schema; a tokens-only server uses none of them.
    features: dict[str, Any] | None = None
    content_parts: list[dict[str, Any]] | None = None
    token_offsets: list[tuple[int, int]] | None = None
    reasoning_ended: bool | None = None


# --------------------------------------------------------------------------------------------------- responses
# Documentation models for the OpenAPI schema; the server builds the same shapes as dicts.


class LogProbCandidate(BaseModel):
    token_id: int
    token: str = Field(description='"token_id:<id>", the form vLLM <= 0.31 and Prime-RL\'s renderers expect.')
    logprob: float
    rank: int | None = None
    bytes: list[int] | None = None


class LogProbEntry(LogProbCandidate):
    top_logprobs: list[LogProbCandidate] = []


class LogProbs(BaseModel):
    content: list[LogProbEntry] | None = None


class WeightVersionSpan(BaseModel):
    version: str
    start: int
    end: int


class GenerateChoice(BaseModel):
    index: int
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    routed_experts: dict[str, Any] | str | None = None  # --routed-experts-format: Prime-RL's dict, or vLLM's .npy
    sampling_mask: list[list[int]] | None = None
    weight_versions: list[WeightVersionSpan] | None = None
    logprobs: LogProbs | None = None


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int
    prompt_tokens_details: dict[str, int] | None = None
    completion_tokens_details: dict[str, int] | None = None


class GenerateResponse(BaseModel):
    request_id: str
    model: str | None = None
    created: int | None = None
    usage: Usage | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None
    prompt_token_id_logprobs: str | None = None
    prompt_token_ids: list[int] | None = None
    mm_placeholders: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    output_mode: Literal["tokens"] = "tokens"
    choices: list[GenerateChoice]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": desc}
    for code, desc in ((400, "Bad request"), (404, "Unknown model"), (413, "Body too large"),
                       (503, "Engine dead, draining or not ready"))
}
