"""The server around the engine: ``AppState`` (``state``), the control plane (``control``), start-up (``startup``),
the process lifecycle and SIGTERM drain (``lifecycle``), API keys (``security``) and the request log (``reqlog``).
``tito.main`` puts them together into the FastAPI application.

It is also the transport-neutral service layer both transports (HTTP's routers, ``app.grpc``) call down into, each
of them only parsing its requests and shaping its answers: pause / resume (``control_service``), weight updates and
vLLM's weight-transfer calls (``weight_service``), what the server is (``server_info``), a request's data-parallel
rank and its client leaving (``requests``). The one mapping of an engine failure to an answer is
``AppState.engine_error``.

Imports: ``app.core``, ``app.engine``, ``app.weights``; never a transport, and no vLLM.
"""
