"""Strings shared by the server (app/weights/updates.py) and vLLM's worker processes (app/engine/worker.py), and the
workers' test-only fault hook.

Stdlib only.
"""

import logging
import os
from collections.abc import Iterable, Iterator
from typing import Any

# Non-parameter buffers some trainers save (HF rotary caches, BatchNorm counters): recognized and skipped.
BUFFER_SUFFIXES = ("rotary_emb.inv_freq", "rotary_pos_emb.inv_freq", "rotary_emb.cos_cached",
                   "rotary_emb.sin_cached", ".num_batches_tracked")
# Marker the worker puts in front of errors the caller caused (a bad tensor list), so they map to 4xx, not 500.
CLIENT_ERROR = "TITO_CLIENT_ERROR: "
TIMEOUT_ERROR = "TITO_TIMEOUT: "
# Marker on worker errors raised before the model was touched: such a failed update leaves the old weights intact.
UNTOUCHED = "TITO_UNTOUCHED: "

# ------------------------------------------------------------------------------------------ test-only fault hook

# TEST ONLY. When the environment names a file in TITO_TEST_FAULT_FILE, each weight load consumes it (reads, then
# deletes it): "read:N" makes the Nth tensor read raise an I/O error, "shape:N" hands vLLM's loader a wrong-shaped
# Nth tensor (its loader raises mid-load), "skip:NAME" silently drops tensor NAME (the layer then loads nothing).
FAULT_ENV = "TITO_TEST_FAULT_FILE"


def inject_fault(items: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    path = os.environ.get(FAULT_ENV)
    spec = ""
    if path and os.path.exists(path):
        with open(path) as f:
            spec = f.read().strip()
        os.unlink(path)
        logging.getLogger("tito.worker").warning("TEST fault injection active for this load: %s", spec)
    kind, _, arg = spec.partition(":")
    for i, (name, t) in enumerate(items, start=1):
        if kind == "read" and i == int(arg):
            raise OSError(5, f"Input/output error (injected) reading tensor {name!r}")
        if kind == "shape" and i == int(arg):
            t = t[:-1]
        if kind == "skip" and name == arg:
            continue
        yield name, t
