"""Python client for a tito server: ``TitoClient`` (blocking) and ``AsyncTitoClient`` (asyncio) in ``clients``, what
both send and read in ``wire``, and the ``tito`` client commands in ``commands``. ``from app.client import
TitoClient`` is the public import.

Imports: nothing else of tito; httpx and the standard library only (never vLLM or torch), so a trainer pays nothing.
"""

from app.client.clients import (
    AsyncTitoClient,
    Choice,
    GenerateOptions,
    GenerateResult,
    StreamDelta,
    TitoClient,
    TitoError,
    Usage,
    image_parts,
)

__all__ = ["AsyncTitoClient", "Choice", "GenerateOptions", "GenerateResult", "StreamDelta", "TitoClient", "TitoError",
           "Usage", "image_parts"]
