"""The tables of ``python -m benchmarks updates`` (benchmarks/updates.py): per kind of update, engine mode and system,
min / median / max of each measure over the timed updates, and the issue's goals as ratios of round medians."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.report import spread

LABELS = {("tito", "full"): "tito: full update from disk (`/update_weights`)",
          ("vllm", "full"): "vLLM's server: `reload_weights` (`/collective_rpc`)",
          ("tito", "delta"): "tito: staged delta commit (`/commit`)",
          ("tito", "broadcast"): "tito: broadcast over gloo (`/update_weights`)"}
# The goals, on the pause a stream saw, each within a round and a mode: (kind, against, at most).
GOALS = (("full", ("vllm", "full"), 1.0), ("delta", ("vllm", "full"), 0.2), ("broadcast", ("tito", "full"), 1.1))


def report(res: dict[str, Any]) -> str:
    rounds = res["rounds"]
    size, largest = res["checkpoint_bytes"], res["largest_file"]
    rows = [{**r, "mode": r.get("mode", "eager")} for rd in rounds for sysres in rd.values() for r in sysres["rows"]
            if r["kind"] in ("full", "delta", "broadcast") and not r.get("first")]
    modes = sorted({r["mode"] for r in rows}, key=lambda m: m != "default")
    lines = [f"{res['model']}: checkpoint {size / 1e9:.2f} GB (largest file {largest / 1e9:.2f} GB), "
             f"{len(rounds)} round(s), {res['streams']} streams; min / median / max", "",
             "| update | engine | n | seconds | GB/s | pause, client (pause → resume answered) s | "
             "pause a stream saw s | token interval before ms | steady RSS GB | peak RSS above steady GB | "
             "peak anon above GB | RSS after, above GB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (system, kind), label in LABELS.items():
        for mode in modes:
            xs = [r for r in rows if r["system"] == system and r["kind"] == kind and r["mode"] == mode]
            if not xs:
                continue
            lines.append(f"| {label} | {mode} | {len(xs)} | {spread([r['update_s'] for r in xs])} | "
                         f"{spread([r['gbps'] for r in xs])} | {spread([r['pause_s'] for r in xs])} | "
                         f"{spread([r['gap_s'] for r in xs])} | "
                         f"{spread([r['token_s'] * 1000 for r in xs], '{:.0f}')} | "
                         f"{spread([r['steady_rss'] / 1e9 for r in xs])} | "
                         f"{spread([r['peak_rss_above'] / 1e9 for r in xs])} | "
                         f"{spread([r['peak_anon_above'] / 1e9 for r in xs])} | "
                         f"{spread([r['after_rss_above'] / 1e9 for r in xs])} |")
    for mode in modes:
        here = [r for r in rows if r["mode"] == mode]
        ds = [r for r in here if r["kind"] == "delta" and "stage_s" in r]
        if ds:
            lines.append(f"Staged deltas ({mode}): the stage answered in {spread([r['stage_s'] for r in ds])} s, "
                         f"ready for its commit in {sum(bool(r['ready']) for r in ds)} of {len(ds)}; generation "
                         f"while staging, against the 3 s before: "
                         f"{spread([r['staging_rate'] for r in ds if 'staging_rate' in r])}")
            waited = [r for r in ds if not r["ready"] and "ready_s" in r]
            if waited:
                got = [r["ready_s"] for r in waited if r["ready_s"] is not None]
                lines.append(f"Staged deltas ({mode}) not ready when the stage answered: ready {len(got)} of "
                             f"{len(waited)} before the commit (--stage-wait), "
                             f"{spread(got) if got else '-'} s after the stage was sent")
        bs = [r["sender_cpu_s"] for r in here if r["kind"] == "broadcast" and "sender_cpu_s" in r]
        if bs:
            lines.append(f"Broadcasts ({mode}): the trainer process's CPU over each (it shares the machine's cores): "
                         f"{spread(bs)} s")
        cpu = {label.split(" (")[0]: [r["cpu_s"] for r in here if (r["system"], r["kind"]) == key and "cpu_s" in r]
               for key, label in LABELS.items()}
        if any(cpu.values()):
            lines.append(f"CPU seconds of the server's processes over the update call ({mode}): "
                         + "; ".join(f"{k} {spread(v)}" for k, v in cpu.items() if v))
    entries = [(k, v) for rd in rounds for k, v in rd.items()]
    reads = [v["read"] for _, v in entries if "read" in v]
    lines += ["", f"File read speed of the same files, GB/s: cold {spread([r['cold_gbps'] for r in reads])}, "
                  f"warm {spread([r['warm_gbps'] for r in reads])}"]
    for mode in modes:
        tito = [r for r in rows if r["system"] == "tito" and r["kind"] == "full" and r["mode"] == mode]
        own = [r["update_s"] - r["reload_s"] for r in tito if r.get("reload_s") is not None]
        if own:
            retie = [r["retie_s"] for r in tito if r.get("retie_s") is not None]
            lines.append(f"Inside tito's full updates ({mode}): vLLM's reload {spread([r['reload_s'] for r in tito])} "
                         f"s; the tied head after it {spread(retie, '{:.3f}')} s; the rest (validation, record, HTTP) "
                         f"{spread([o - r.get('retie_s', 0.0) for o, r in zip(own, tito, strict=False)], '{:.3f}')} s")
    lines += ["", "Goals, the pause a stream saw, the ratio of the round medians, round by round (min / median / max):"]
    for mode in modes:
        for kind, (against, akind), goal in GOALS:
            ratios = []
            for rd in rounds:
                here = [r for sysres in rd.values() for r in sysres["rows"] if r.get("mode", "eager") == mode
                        and not r.get("first")]
                ts = [r["gap_s"] for r in here if r["system"] == "tito" and r["kind"] == kind]
                vs = [r["gap_s"] for r in here if r["system"] == against and r["kind"] == akind]
                if ts and vs:
                    ratios.append(statistics.median(ts) / statistics.median(vs))
            if ratios:
                met = "met" if max(ratios) <= goal else "missed"
                lines.append(f"- {mode}: tito {kind} / {LABELS[(against, akind)].split(':')[0]} {akind}: "
                             f"{spread(ratios)} (goal ≤ {goal}: {met})")
        peaks = [r["peak_rss_above"] for r in rows if r["mode"] == mode]
        if peaks:
            lines.append(f"- {mode}: peak RSS above steady, every update: at most {max(peaks) / 1e9:.2f} GB (goal ≤ "
                         f"{1.1 * largest / 1e9:.2f} GB, the largest file + 10 %: "
                         f"{'met' if max(peaks) <= 1.1 * largest else 'missed'})")
    skipped = [f"{k}: {v['skipped']}" for k, v in entries if "skipped" in v]
    if skipped:
        lines.append("Skipped (memory): " + "; ".join(skipped))
    starts: dict[str, list[float]] = {}
    for k, v in entries:
        if "start_s" in v:
            starts.setdefault(k, []).append(v["start_s"])
    lines.append("Seconds to healthy: " + "; ".join(f"{k} {spread(v, '{:.0f}')}" for k, v in sorted(starts.items())))
    profiles = [(k, v["profile"]) for k, v in entries if v.get("profile")]
    for k, path in profiles:
        lines.append(f"py-spy of {k}'s engine during its timed updates: {path}")
    if res.get("soak"):
        sk = res["soak"]
        a, b = sk["after_rss"], sk["after_anon"]
        lines += ["", f"Soak: {len(sk['rows'])} full updates under {res['streams']} streams; RSS after each (GB): "
                      + ", ".join(f"{x / 1e9:.2f}" for x in a),
                  f"slope {sk['slope_rss'] / 1e6:+.1f} MB/update (anon {sk['slope_anon'] / 1e6:+.1f}); last - first "
                  f"{(a[-1] - a[0]) / 1e9:+.3f} GB (anon {(b[-1] - b[0]) / 1e9:+.3f}); update s "
                  f"{spread([r['update_s'] for r in sk['rows']])}; peak above steady GB "
                  f"{spread([r['peak_rss_above'] / 1e9 for r in sk['rows']])}; stream errors {sk['stream_errors']}"]
    return "\n".join(lines)
