"""Weights: checkpoint validation and the one-at-a-time weight-update orchestration (``updates``: ``WeightManager``),
LoRA adapter validation (``lora_check``) and registry (``lora``: ``LoraManager``), the safetensors header reader
(``safetensors_meta``) and the paths a caller may make tito read (``paths``). The worker side of an update is
``app.engine.worker``.

Imports: ``app.core`` and ``app.engine`` (the engine only through ``app.engine.adapter.Engine``); no vLLM.
"""
