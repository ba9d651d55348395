"""How the benchmarks report a figure: its spread over runs (min / median / max), percentiles, ratios taken round by
round, and the JSON files a run leaves behind."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any


def spread(xs: list[float], fmt: str = "{:.2f}") -> str:
    """``min / median / max`` of ``xs`` as the tables print them; ``–`` when there is none."""
    if not xs:
        return "–"
    return " / ".join(fmt.format(x) for x in (min(xs), statistics.median(xs), max(xs)))


def spread_of(xs: list[float]) -> list[float] | None:
    """[min, median, max] of one figure over rounds: how far the machine's noise moves it."""
    return [min(xs), statistics.median(xs), max(xs)] if xs else None


def pct(xs: list[float], p: float, scale: float = 1000.0) -> float | None:
    """The ``p``-th percentile of ``xs`` (nearest rank) times ``scale`` (seconds to ms by default)."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))] * scale


def fmt(v: Any, nd: int = 0) -> str:
    """A table cell: ``-`` for None, floats with thousands separators and ``nd`` decimals."""
    if v is None:
        return "-"
    return f"{v:,.{nd}f}" if isinstance(v, float) else str(v)


def slope(ys: list[float]) -> float:
    """Least-squares change of ``ys`` per step (bytes per update, for a soak)."""
    n = len(ys)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2, statistics.fmean(ys)
    return sum((i - mx) * (y - my) for i, y in enumerate(ys)) / sum((i - mx) ** 2 for i in range(n))


def write(out: Path, name: str, doc: dict[str, Any]) -> Path:
    """``<name>.json`` under ``out`` and a time-stamped copy beside it (``<name>-YYYYmmdd-HHMMSS.json``)."""
    text = json.dumps(doc, indent=1)
    (out / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(text)
    (out / f"{name}.json").write_text(text)
    return out / f"{name}.json"
