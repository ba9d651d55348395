"""What vLLM's workers report about a weight reload: the time vLLM's own reload took, and what it kept as is."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("tito.weights")


def reload_seconds(results: list[Any] | None, key: str = "reload_seconds") -> float | None:
    """The slowest worker's ``reload_seconds`` (vLLM's reload), or another of the workers' timings (``key``), if the
    workers reported one."""
    times = [float(r[key]) for r in results or [] if isinstance(r, dict) and key in r]
    return max(times) if times else None


def log_kept(results: list[Any] | None) -> None:
    """One INFO line per update for what vLLM's reload kept as is: layers that hold only buffers no checkpoint has
    (the rotary ``cos_sin_cache``), whose "Failed to load weights" warning the workers drop."""
    rows = [r for r in results or [] if isinstance(r, dict) and "kept" in r]
    if not rows:
        return
    kept: dict[str, int] = {}
    for r in rows:
        for layer, n in r["kept"].items():
            kept[layer] = max(kept.get(layer, 0), int(n))
    same = all(r.get("rotary_before") == r.get("rotary_after") for r in rows)
    digests = sorted({str(r.get("rotary_after")) for r in rows})
    what = ", ".join(f"{n} {layer}" for layer, n in sorted(kept.items())) or "nothing"
    if same:
        log.info("weights reloaded; kept as is (non-checkpoint buffers only): %s; rotary caches bit-identical "
                 "before and after (%s)", what, ",".join(digests))
    else:
        log.warning("weights reloaded; kept as is: %s; rotary caches CHANGED during the reload (%s)", what,
                    ", ".join(f"{r.get('rotary_before')}->{r.get('rotary_after')}" for r in rows))
