"""tito behind Dynamo (the ``dynamo`` extra): ``tito serve --dynamo-namespace`` runs Dynamo's own vLLM sidecar
(``python -m dynamo.vllm.sidecar``) as a child process for tito's gRPC port (``sidecar``: its command line), supervised
(``supervisor``: started once the server is ready, stopped first when it drains or stops, restarted if it dies). The
sidecar speaks vLLM's native gRPC services (``app.grpc``); it can also be started by hand.

Imports: ``app.core`` (settings). It starts a process, never touches the engine.
"""
