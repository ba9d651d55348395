"""tito's gRPC front end (``tito serve --grpc-port``, the ``grpc`` extra): the ``grpc.aio`` server (``server``), smg's
``VllmEngine`` service on tito's state (``servicer``), vLLM's native ``vllm.Control`` / ``vllm.Inference`` that
Dynamo's vLLM sidecar drives (``vllm_native``: registration and trust boundary; ``vllm_control``; ``vllm_inference``,
with the text it decodes beside the engine in ``detokenize``; their generated modules in ``proto``), the token API's
path that both generate services take (``token_request``), HTTP statuses as gRPC codes (``status``) and the KV-event
relay (``kv_events``).

Imports: ``app.core``, ``app.engine``, ``app.server`` (the service layer HTTP calls too: server info, pause / resume,
weight updates, data-parallel rank); never the HTTP routes, and no vLLM.
"""
