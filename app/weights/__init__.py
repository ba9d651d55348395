"""Weights: checkpoint validation and the one-at-a-time weight-update orchestration (``updates``: ``WeightManager``),
LoRA adapter validation (``lora_check``) and registry (``lora``: ``LoraManager``), the safetensors header reader
(``safetensors_meta``), the paths a caller may make tito read (``paths``), and staged versions (Prime-RL's stage/commit:
``staging``, with the uploads in progress in ``stage_uploads`` and the delta check, in a process of its own, in
``delta_check``), and the record of what was committed, restored at start (``record``, ``restore``). The worker side
of an update is ``app.engine.worker`` (``worker_delta`` for a staged delta).

Imports: ``app.core`` and ``app.engine`` (the engine only through ``app.engine.adapter.Engine``); no vLLM.
"""
