"""Metadata: ``GET /v1/models`` (vLLM's shape, with ``max_model_len``), ``GET /version`` and ``GET /server_info``
(its body: app/server/server_info.py, shared with gRPC; the route map is HTTP's own)."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.routing import APIRoute
from starlette.responses import Response

from app import __version__
from app.core.protocol import GENERATE_PATH, json_response
from app.engine.adapter import vllm_version
from app.server.security import Plane, classify
from app.server.server_info import server_info_body
from app.server.state import AppState, get_state

router = APIRouter(tags=["info"])



def _card(model_id: str, root: str, parent: str | None, created: int, max_model_len: int) -> dict[str, object]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "tito", "root": root,
            "parent": parent, "max_model_len": max_model_len, "permission": []}


@router.get("/v1/models", summary="Served model and loaded LoRA adapters")
async def models(state: AppState = Depends(get_state)) -> Response:
    f = state.facts
    created = int(state.started_at)
    data = [_card(f.name, f.path, None, created, f.max_model_len)]
    data += [_card(e.name, e.path, f.name, int(e.loaded_at), f.max_model_len) for e in state.loras.values()]
    return json_response({"object": "list", "data": data})


@router.get("/version", summary="tito and vLLM versions")
async def version() -> Response:
    return json_response({"version": __version__, "vllm_version": vllm_version()})


# --------------------------------------------------------------------------------------------------- /server_info


def route_map(request: Request, protect_metrics: bool = False) -> dict[str, Any]:
    """Every API route of the running app (so the map stays true as routers are added), with its plane."""
    base = str(request.base_url).rstrip("/")
    routes: list[dict[str, Any]] = []
    planes: dict[str, set[str]] = {p.value: set() for p in Plane}
    for r in request.app.routes:
        if not isinstance(r, APIRoute) or not r.include_in_schema:
            continue
        plane = classify(r.path, protect_metrics).value
        planes[plane].add(r.path)
        routes.append({"path": r.path, "methods": sorted(r.methods or ()), "name": r.name, "plane": plane})
    routes.sort(key=lambda x: (x["path"], x["methods"]))
    return {"base_url": base, "generate_url": base + GENERATE_PATH, "generate_path": GENERATE_PATH,
            "admin": sorted(planes[Plane.ADMIN.value]), "data": sorted(planes[Plane.DATA.value]),
            "open": sorted(planes[Plane.OPEN.value]), "all": routes}


@router.get("/server_info", summary="What this server is: model, limits, parallelism, features, state, routes; "
                                    "and vLLM's vllm_config / vllm_env")
async def server_info(request: Request, config_format: Literal["text", "json"] = Query(
                          "text", description="vllm_config as vLLM's text, or its JSON tree (what TRL reads)."),
                      state: AppState = Depends(get_state)) -> Response:
    body = await server_info_body(state, route_map(request, state.settings.protect_metrics))
    # vLLM's own keys beside tito's, so clients that read a vLLM server's config (TRL) parse this one.
    body.update(state.engine.vllm_server_info(config_format))
    return json_response(body)
