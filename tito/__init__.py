"""The composition root: ``main`` (``create_app``: the HTTP routers, middleware, lifespan with the gRPC services and
Dynamo's sidecar) and ``cli`` (the ``tito`` command; ``python -m tito``) put the packages of ``app/`` and the HTTP
transport ``routers/`` together. Nothing under ``app/`` or ``routers/`` imports this package.
"""
