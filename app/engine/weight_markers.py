"""Strings shared by the server (app/weights/updates.py) and vLLM's worker processes (app/engine/worker.py).

Stdlib only.
"""

# Non-parameter buffers some trainers save (HF rotary caches, BatchNorm counters): recognized and skipped.
BUFFER_SUFFIXES = ("rotary_emb.inv_freq", "rotary_pos_emb.inv_freq", "rotary_emb.cos_cached",
                   "rotary_emb.sin_cached", ".num_batches_tracked")
# Marker the worker puts in front of errors the caller caused (a bad tensor list), so they map to 4xx, not 500.
CLIENT_ERROR = "TITO_CLIENT_ERROR: "
TIMEOUT_ERROR = "TITO_TIMEOUT: "
# Marker on worker errors raised before the model was touched: such a failed update leaves the old weights intact.
UNTOUCHED = "TITO_UNTOUCHED: "
