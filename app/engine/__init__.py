"""The engine: the one adapter around vLLM's ``AsyncLLM`` (``adapter``: ``Engine``), its multimodal half
(``multimodal``), wire sampling parameters to vLLM's ``SamplingParams`` (``sampling``), vLLM's OpenAI serving layer
behind tito's checks and in-flight accounting (``openai_layer``), vLLM's exceptions as tito's (``errors``), vLLM's own
server-info keys (``vllm_config``), and the code that runs inside vLLM's worker processes (``worker``, its
staged-delta half ``worker_delta``, with the ``weight_markers`` and the sparse delta codec ``delta_format`` it shares
with the server, and ``safe_pickle``).

Imports: ``app.core``; the only package that imports vLLM. ``worker`` must stay importable in a freshly spawned
process: it, ``worker_delta``, ``worker_prebuild`` and ``weight_layout`` import nothing of tito but these
neighbours, and this file imports nothing.
"""
