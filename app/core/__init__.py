"""What every package shares: the HTTP wire models and ``ApiError`` (``protocol``), the multimodal request checks that
need no engine (``multimodal``), every server flag (``settings``) and tito's Prometheus families (``metrics``).

Imports: nothing else of tito (the bottom layer), and no vLLM.
"""
