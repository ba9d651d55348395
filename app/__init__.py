"""tito: a token-in/token-out inference server for RL rollouts, on a real vLLM engine.

One package per concern, bottom up: ``core`` (wire models, settings, metrics), ``engine`` (the adapter around vLLM,
the only package that imports it), ``weights`` (weight updates, LoRA adapters), ``server`` (``AppState``, control
plane, start-up, lifecycle, security); beside them ``client``, ``dynamo``, ``tiny``; on top ``routers/`` (HTTP) and
``grpc``. The composition root that puts them together (``create_app``, the ``tito`` command) is the top-level
package ``tito``, which nothing here imports.
"""

__version__ = "0.1.0"
