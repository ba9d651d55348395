"""Tiny random-weight models that vLLM serves on CPU, written offline and deterministically: the default text model
(``model``), its tokenizer (``tokenizer``) and a vision-language model (``vlm``). For tests, benches and ``make serve``.

Imports: nothing else of tito.
"""
