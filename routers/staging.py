"""Prime-RL's staged weight routes: ``/stage`` (a path or a multipart file), the chunked (``/stage_chunk``,
``/stage_finalize``) and streaming (``/stage_stream_init``, ``/stage_stream_chunk``, ``/stage_stream_finalize``)
uploads, ``/commit``, and ``/weight_status``. Fields come form-encoded, as JSON, or in the query string, as Prime's
client sends them; unknown fields (``relay``, ``resume``) are ignored. The rules live in app/weights/staging.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request
from starlette.datastructures import UploadFile
from starlette.responses import Response

from app.core.protocol import ERROR_RESPONSES, ApiError, json_response
from app.engine.delta_format import SAFETENSORS_NAME, resolve_artifact
from app.server.state import AppState, get_state
from app.server.weight_service import commit_staged
from app.weights.paths import resolve_allowed
from app.weights.stage_uploads import UPLOAD_COPY_BLOCK, Upload, background, safe_component
from app.weights.staging import WORKER_RPC_TIMEOUT, StagingManager

log = logging.getLogger("tito.staging")
router = APIRouter(tags=["staging"])

STAGE_ROUTES = ("/stage", "/stage_chunk", "/stage_stream_chunk")  # the routes that carry weight bytes


async def read_fields(request: Request) -> tuple[dict[str, Any], UploadFile | None, Any]:
    """Query parameters, then the JSON object or form fields of the body; the multipart part ``file`` if any (and the
    form, to close)."""
    fields: dict[str, Any] = dict(request.query_params)
    ctype = request.headers.get("content-type", "")
    if ctype.startswith("application/json"):
        try:
            body = orjson.loads(await request.body() or b"{}")
        except orjson.JSONDecodeError:
            raise ApiError(400, "request body is not valid JSON.", param="body") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object.", param="body")
        fields.update({k: v for k, v in body.items() if v is not None})
        return fields, None, None
    if ctype.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        form = await request.form(max_files=2, max_fields=64)
        upload = None
        for k, v in form.multi_items():
            if isinstance(v, UploadFile):
                if k == "file":
                    upload = v
            else:
                fields[k] = v
        return fields, upload, form
    return fields, None, None


@asynccontextmanager
async def request_fields(request: Request) -> AsyncIterator[tuple[dict[str, Any], UploadFile | None]]:
    """``read_fields`` for a block: the form (and its spooled file part) is closed when the block ends."""
    fields, upload, form = await read_fields(request)
    try:
        yield fields, upload
    finally:
        if form is not None:
            await form.close()


async def fields_only(request: Request) -> dict[str, Any]:
    """The fields of a call that carries no file."""
    async with request_fields(request) as (fields, _):
        return fields


def field_str(fields: dict[str, Any], name: str, required: bool = True) -> str | None:
    v = fields.get(name)
    if v is None or v == "":
        if required:
            raise ApiError(400, f"{name} is required.", param=name)
        return None
    if not isinstance(v, (str, int)) or isinstance(v, bool) or len(str(v)) > 256:
        raise ApiError(400, f"{name} must be a string of at most 256 characters.", param=name)
    return str(v)


def field_int(fields: dict[str, Any], name: str) -> int:
    raw = field_str(fields, name)
    try:
        v = int(str(raw))
    except ValueError:
        raise ApiError(400, f"{name} must be an integer.", param=name) from None
    if v < 0:
        raise ApiError(400, f"{name} must be non-negative.", param=name)
    return v


def checked(mgr: StagingManager, fields: dict[str, Any]) -> tuple[str, str, str | None]:
    """A stage call's (version, mode, base_version) from its fields, checked by Prime-RL's rules."""
    version = field_str(fields, "version")
    assert version is not None
    mode = field_str(fields, "mode", required=False) or "full"
    return mgr.check(version, mode, field_str(fields, "base_version", required=False))


def _mgr(state: AppState) -> StagingManager:
    state.check_engine()
    return state.staging


async def _save(upload: UploadFile, dest: Path) -> int:
    """Copy a multipart file part (spooled by the form parser) to ``dest`` in a thread."""
    def copy() -> int:
        upload.file.seek(0)
        with open(dest, "wb") as out:
            shutil.copyfileobj(upload.file, out, UPLOAD_COPY_BLOCK)
        return dest.stat().st_size

    return int(await background(copy))


# ------------------------------------------------------------------------------------------ /stage


@router.post("/stage", responses=ERROR_RESPONSES, summary="Stage a weight version (a path, or a multipart file)")
async def stage(request: Request, state: AppState = Depends(get_state)) -> Response:
    mgr = _mgr(state)
    async with request_fields(request) as (fields, upload):
        version, mode, base = checked(mgr, fields)
        if upload is not None:
            name = safe_component(os.path.basename(upload.filename or SAFETENSORS_NAME))
            owned = mgr.new_dir(version)
            dest = owned / name
            try:
                if await _save(upload, dest) > mgr.uploads.max_bytes:
                    raise ApiError(413, f"upload is over the limit of {mgr.uploads.max_bytes} bytes "
                                        "(--max-stage-bytes).", param="file")
            except BaseException:
                shutil.rmtree(owned, ignore_errors=True)
                raise
            out = await mgr.register(version, mode, base, dest, "multipart", name, owned)
        elif field_str(fields, "path", required=False) is not None:
            raw = str(fields["path"])
            path = resolve_allowed(state.settings, raw, "path")
            try:
                artifact = resolve_artifact(path) if mode == "delta" else path
            except FileNotFoundError:
                raise ApiError(404, f"staged path does not exist: {raw}", param="path") from None
            if not artifact.exists():
                raise ApiError(404, f"staged path does not exist: {raw}", param="path")
            out = await mgr.register(version, mode, base, artifact, "path", raw, None)
        else:
            raise ApiError(400, "no file uploaded and no path given.", param="path")
    return json_response(out)


# ------------------------------------------------------------------------------------------ chunked


def _chunked(mgr: StagingManager, fields: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    version, mode, base = checked(mgr, fields)
    total = field_int(fields, "total_size")
    meta: dict[str, Any] = {"version": version, "mode": mode, "base_version": base,
                            "filename": safe_component(os.path.basename(field_str(fields, "filename") or "")),
                            "total_size": total, "sha256": (field_str(fields, "sha256") or "").lower()}
    if total > mgr.uploads.max_bytes:
        raise ApiError(413, f"total_size {total} is over the limit of {mgr.uploads.max_bytes} bytes "
                            "(--max-stage-bytes).", param="total_size")
    key = "chunked:" + hashlib.sha256(orjson.dumps(meta, option=orjson.OPT_SORT_KEYS)).hexdigest()[:32]
    return key, meta


async def _finish(mgr: StagingManager, up: Upload, size: int, sha256: str | None, transport: str) -> dict[str, Any]:
    meta = up.meta

    async def complete(path: Path, digest: str) -> dict[str, Any]:
        # Rules again: the active version may have moved since the upload began.
        mgr.check(meta["version"], meta["mode"], meta["base_version"])
        owned = mgr.new_dir(meta["version"])
        dest = owned / meta["filename"]
        await background(os.replace, path, dest)
        return await mgr.register(meta["version"], meta["mode"], meta["base_version"], dest, transport,
                               meta["filename"], owned, digest)

    try:
        return await mgr.uploads.finish(up, size, sha256, complete)
    finally:
        mgr.count_uploads()


@router.post("/stage_chunk", responses=ERROR_RESPONSES, summary="One chunk of a chunked stage upload (any order)")
async def stage_chunk(request: Request, state: AppState = Depends(get_state)) -> Response:
    mgr = _mgr(state)
    async with request_fields(request) as (fields, upload):
        key, meta = _chunked(mgr, fields)
        offset = field_int(fields, "offset")
        if upload is None:
            raise ApiError(400, "the chunk's multipart file part `file` is missing.", param="file")
        up = mgr.uploads.open(key, meta, key.replace(":", "-"))
        data = await background(lambda: (upload.file.seek(0), upload.file.read())[1])
        await mgr.uploads.write(up, offset, data, len(data))
        mgr.count_uploads()
    return json_response({"status": "ok", "version": meta["version"], "mode": meta["mode"],
                          "received_bytes": up.received, "finalized": up.result is not None})


@router.post("/stage_finalize", responses=ERROR_RESPONSES, summary="Check and stage a chunked upload")
async def stage_finalize(request: Request, state: AppState = Depends(get_state)) -> Response:
    mgr = _mgr(state)
    key, meta = _chunked(mgr, await fields_only(request))
    up = mgr.uploads.get(key)
    if up is None:
        raise ApiError(404, f"no chunked upload of {meta['filename']} for version {meta['version']} (send its "
                            "chunks first).")
    return json_response(await _finish(mgr, up, meta["total_size"], meta["sha256"] or None, "chunked"))


# ------------------------------------------------------------------------------------------ streaming


@router.post("/stage_stream_init", responses=ERROR_RESPONSES, summary="Start (or look up) a streaming stage upload")
async def stage_stream_init(request: Request, state: AppState = Depends(get_state)) -> Response:
    mgr = _mgr(state)
    fields = await fields_only(request)
    upload_id = field_str(fields, "upload_id", required=False) or os.urandom(16).hex()
    up = mgr.uploads.get("stream:" + upload_id)
    if up is not None and up.result is not None:
        # Already complete (a retried init): the client skips the chunks and finalizes, which answers the same.
        return json_response({"status": "ok", "upload_id": upload_id, "version": up.meta["version"],
                              "mode": up.meta["mode"], "finalized": True})
    version, mode, base = checked(mgr, fields)
    if mode != "delta":
        raise ApiError(400, "streaming uploads carry deltas only (mode=delta).", param="mode")
    meta = {"version": version, "mode": mode, "base_version": base,
            "filename": safe_component(os.path.basename(field_str(fields, "filename", required=False) or
                                                        "delta.stream"))}
    up = mgr.uploads.open("stream:" + upload_id, meta, "stream-" + safe_component(upload_id))
    mgr.count_uploads()
    return json_response({"status": "ok", "upload_id": upload_id, "version": version, "mode": mode,
                          "finalized": False, "received_bytes": up.received})


def _stream(mgr: StagingManager, fields: dict[str, Any]) -> Upload:
    upload_id = field_str(fields, "upload_id")
    up = mgr.uploads.get(f"stream:{upload_id}")
    if up is None:
        raise ApiError(404, f"streaming upload {upload_id} not found (call /stage_stream_init first).",
                       param="upload_id")
    if up.result is None:
        mgr.check(up.meta["version"], up.meta["mode"], up.meta["base_version"])
    return up


@router.post("/stage_stream_chunk", responses=ERROR_RESPONSES, summary="Raw bytes of a streaming upload at an offset")
async def stage_stream_chunk(request: Request, state: AppState = Depends(get_state)) -> Response:
    mgr = _mgr(state)
    fields = dict(request.query_params)
    up = _stream(mgr, fields)
    offset = field_int(fields, "offset")
    data = await request.body()
    if not data and up.result is None:
        raise ApiError(400, "the chunk body is empty.", param="body")
    await mgr.uploads.write(up, offset, data, len(data))
    return json_response({"status": "ok", "upload_id": fields["upload_id"], "version": up.meta["version"],
                          "mode": up.meta["mode"], "received_bytes": up.received,
                          "finalized": up.result is not None})


@router.post("/stage_stream_finalize", responses=ERROR_RESPONSES, summary="Check and stage a streaming upload")
async def stage_stream_finalize(request: Request, state: AppState = Depends(get_state)) -> Response:
    mgr = _mgr(state)
    fields = await fields_only(request)
    up = _stream(mgr, fields)
    size = field_int(fields, "final_size")
    return json_response(await _finish(mgr, up, size, field_str(fields, "sha256", required=False), "streaming"))


# ------------------------------------------------------------------------------------------ commit


@router.post("/commit", responses=ERROR_RESPONSES, summary="Apply a staged version (under the pause)")
async def commit(request: Request, state: AppState = Depends(get_state)) -> Response:
    state.check_engine()
    fields = await fields_only(request)
    version = field_str(fields, "version")
    assert version is not None
    return json_response(await commit_staged(state, version, field_str(fields, "mode", required=False)))


@router.get("/weight_layout", responses=ERROR_RESPONSES,
            summary="Where HF tensors land in vLLM's parameters, and which a delta commit writes in place")
async def weight_layout(request: Request, state: AppState = Depends(get_state)) -> Response:
    state.check_engine()
    expected = await state.weights.expected()
    names = [n for raw in request.query_params.getlist("name") for n in raw.split(",") if n]
    if not 0 < len(names) <= 64:
        # Tracing runs each tensor's loader on an index tensor inside the workers: a diagnostic for a few names.
        raise ApiError(400, "name: 1 to 64 HF tensor names (repeat it, or comma-separate).", param="name")
    unknown = [n for n in names if n not in expected]
    if unknown:
        raise ApiError(404, f"the model has no tensor(s) {unknown[:4]}.", param="name")
    workers = await asyncio.wait_for(state.engine.delta_layout({n: list(expected[n].shape) for n in names}),
                                     WORKER_RPC_TIMEOUT)
    return json_response({"workers": workers})


@router.get("/weight_status", responses=ERROR_RESPONSES, summary="Active and staged weight versions")
async def weight_status(state: AppState = Depends(get_state)) -> Response:
    mgr = state.staging
    if not state.engine.errored:
        try:  # the workers' host copy as it is now (filled in the background after a stage)
            mgr.workers = await asyncio.wait_for(state.engine.delta_status(), WORKER_RPC_TIMEOUT)
        except Exception as e:  # noqa: BLE001 - the status still answers, with the last known copy state
            log.warning("delta_status failed: %s", e)
    info = mgr.info()
    return json_response({"active_version": info["active_version"], "active_sha256": info["active_sha256"],
                          "weights_dirty": info["dirty"], "serving_ready": state.not_ready_reason is None,
                          "weight_version": state.weight_version, "staged": info["staged"],
                          "workers": info["workers"]})
