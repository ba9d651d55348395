"""tito behind Dynamo (the ``dynamo`` extra): ``tito serve --dynamo-namespace`` runs Dynamo's own vLLM sidecar
(``python -m dynamo.vllm.sidecar``) as a child process for tito's gRPC port (``sidecar``). The sidecar speaks vLLM's
native gRPC services (``app.grpc``); it can also be started by hand.

Imports: ``app.core`` (settings). It starts a process, never touches the engine.
"""
