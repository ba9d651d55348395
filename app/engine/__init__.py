"""The engine: the one adapter around vLLM's ``AsyncLLM`` (``adapter``: ``Engine``), ``tito serve``'s command line as
vLLM's (``vllm_args``: vLLM's serve parser with tito's flags, where each argument goes) and the engine configuration
built from it (``engine_setup``), its multimodal half
(``multimodal``), the one validator of sampling parameters and wire params to vLLM's ``SamplingParams``
(``sampling``), vLLM's OpenAI serving layer behind tito's checks and in-flight accounting (``openai_layer``; its
completion streams written without a model per chunk: ``openai_stream``), vLLM's
exceptions as tito's (``errors``), vLLM's own server-info keys (``vllm_config``), routed experts as the wire carries
them (``routed_experts``), the adapter's calls into its workers (``worker_calls``), and the code that runs inside
vLLM's worker processes (``worker``: checkpoint reloads, its trainer-broadcast half ``worker_broadcast`` and
staged-delta half ``worker_delta`` with the copy of the weights it adds to, ``delta_copy``; tito's fixes to vLLM in
``vllm_patches`` (the CPU runner's in ``vllm_patches_runner``), with the ``weight_markers`` and the sparse delta
codec ``delta_format`` it shares with the server, and ``safe_pickle``).

Imports: ``app.core``; the only package that imports vLLM. ``worker`` must stay importable in a freshly spawned
process: it, ``worker_broadcast``, ``worker_delta``, ``delta_copy``, ``worker_prebuild`` and ``weight_layout``
import nothing of tito but these neighbours, and this file imports nothing.
"""
