"""The server around the engine: ``AppState`` (``state``), the control plane (``control``), start-up (``startup``),
the process lifecycle and SIGTERM drain (``lifecycle``), API keys (``security``) and the request log (``reqlog``).
``app.main`` puts them together into the FastAPI application.

Imports: ``app.core``, ``app.engine``, ``app.weights``; no vLLM.
"""
