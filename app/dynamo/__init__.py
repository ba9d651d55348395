"""tito behind Dynamo (the ``dynamo`` extra): the adapter process beside tito (``adapter``: ``tito dynamo-register``)
and the pure translation between Dynamo's request plane and tito's HTTP API (``wire``).

Imports: ``app.core`` (settings) and ``app.client`` (the SSE parser). It reaches tito over HTTP, never the engine.
"""
