"""tito's gRPC front end (``tito serve --grpc-port``, the ``grpc`` extra): the ``grpc.aio`` server (``server``), vLLM's
``VllmEngine`` service on tito's state (``servicer``), HTTP statuses as gRPC codes (``status``) and the KV-event relay
(``kv_events``).

Imports: ``app.core``, ``app.engine``, ``app.server``, and ``routers.info`` (the same server info as HTTP); no vLLM.
"""
