"""HTTP routers, one module per concern. ``ALL`` is the order they are mounted in. A route parses its request and
shapes its answer; what it does is in the service layer (``app.server``), shared with gRPC.

Imports: ``app.core``, ``app.engine``, ``app.weights``, ``app.server``; routers speak HTTP and import no vLLM. Nothing
under app/ imports them; ``tito.main`` (the composition root) mounts them.
"""

from __future__ import annotations

from fastapi import APIRouter

from routers import areal, control, generate, health, info, lifecycle, lora, metrics, openai, staging, weights

ALL: list[APIRouter] = [generate.router, health.router, info.router, metrics.router, lora.router, control.router,
                         weights.router, staging.router, lifecycle.router, openai.router,
                         areal.router]
