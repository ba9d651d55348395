"""The engine: the one adapter around vLLM's ``AsyncLLM`` (``adapter``: ``Engine``), its multimodal half
(``multimodal``), wire sampling parameters to vLLM's ``SamplingParams`` (``sampling``), and the code that runs inside
vLLM's worker processes (``worker``, with the ``weight_markers`` it shares with the server and ``safe_pickle``).

Imports: ``app.core``; the only package that imports vLLM. ``worker`` must stay importable in a freshly spawned
process: it imports nothing of tito but its two neighbours, and this file imports nothing.
"""
