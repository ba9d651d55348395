"""The serving benchmark's report (benchmarks/serving.py): medians over rounds, the table on stdout and the chart."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.clients import Workload
from benchmarks.report import fmt, spread_of


def median_of(rounds: list[dict[str, Any]], system: str, wl: str, key: str) -> float | None:
    vals = [r[system][wl][key] for r in rounds
            if system in r and wl in r[system] and r[system][wl].get(key) is not None]
    return statistics.median(vals) if vals else None


def per_round(rounds: list[dict[str, Any]], system: str, wl: str, key: str) -> list[float]:
    return [r[system][wl][key] for r in rounds
            if system in r and wl in r[system] and r[system][wl].get(key) is not None]


def build_summary(rounds: list[dict[str, Any]], systems: list[str], workloads: list[Workload]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for wl in workloads:
        row: dict[str, Any] = {}
        for s in systems:
            row[s] = {k: median_of(rounds, s, wl.name, k)
                      for k in ("tok_s", "req_s", "p50_ms", "p99_ms", "cpu_ms_per_req", "client_cpu_ms_per_req",
                               "burned_cores")}
            row[s]["errors"] = sum(r[s][wl.name]["errors"] for r in rounds if s in r and wl.name in r[s])
        key = {"tok/s": "tok_s", "req/s": "req_s", "p50": "p50_ms"}[wl.metric]
        for s in systems:
            row[s]["spread"] = {k: spread_of(per_round(rounds, s, wl.name, k)) for k in (key, "cpu_ms_per_req")}
        if {"tito", "base"} <= set(systems):
            row["ab"] = ab_rounds(rounds, wl.name, key)
        for other in ("inprocess", "vllm", "matched"):
            if "tito" in row and other in row and row["tito"][key] and row[other][key]:
                ratio = row["tito"][key] / row[other][key]
                row[f"tito/{other}"] = ratio if key != "p50_ms" else None
                if key == "p50_ms":
                    row[f"tito-{other}_p50_ms"] = row["tito"][key] - row[other][key]
        summary[wl.name] = row
    cold = {s: sum(r[s]["warmup"]["errors"] for r in rounds if s in r) for s in systems}
    added = added_cpu(summary, rounds, systems, workloads)
    keys = ("server_rss_mb", "server_uss_mb", "engine_rss_mb")
    memory: dict[str, Any] = {s: {k: statistics.median([r[s]["memory"][k] for r in rounds if s in r]) for k in keys}
              for s in systems if any(s in r for r in rounds)}
    # What tito itself adds to the memory of a process that runs vLLM's engine client: the API process of both
    # imports torch and vLLM, so their USS difference is tito's own share (FastAPI, uvicorn, its code and buffers).
    if "tito" in memory and "inprocess" in memory:
        memory["tito_own_mb"] = memory["tito"]["server_uss_mb"] - memory["inprocess"]["server_uss_mb"]
    return {"workloads": summary, "cold_errors": cold, "memory": memory, "added": added}


def ab_rounds(rounds: list[dict[str, Any]], wl: str, key: str) -> dict[str, Any]:
    """tito against base, round by round (each round ran both, back to back): the ratio of the workload's figure,
    and the difference of the serving process's CPU per request."""
    out: dict[str, list[float]] = {"ratio": [], "cpu_diff_ms": []}
    for r in rounds:
        try:
            t, b = r["tito"][wl], r["base"][wl]
        except KeyError:
            continue
        if t.get(key) and b.get(key):
            out["ratio"].append(t[key] / b[key])
        if t.get("cpu_ms_per_req") is not None and b.get("cpu_ms_per_req") is not None:
            out["cpu_diff_ms"].append(t["cpu_ms_per_req"] - b["cpu_ms_per_req"])
    return {k: spread_of(v) for k, v in out.items()} | {"rounds": len(out["ratio"])}


def added_cpu(summary: dict[str, Any], rounds: list[dict[str, Any]], systems: list[str],
              workloads: list[Workload]) -> dict[str, Any]:
    """Per workload: the CPU per request each server's API process spends above the in-process engine client for
    the same work (the measure of a server's own cost), and tito's figure (and the base checkout's) over vLLM's
    server's. Ratios are taken round by round (each round's systems ran back to back) and their median reported, so a
    slow spell of a shared machine falls on both sides of each ratio."""
    if "inprocess" not in systems:
        return {}
    out: dict[str, Any] = {}
    for wl in workloads:
        row: dict[str, Any] = {}
        floor = summary[wl.name]["inprocess"]["cpu_ms_per_req"]
        for s in ("tito", "base", "vllm"):
            cpu = summary[wl.name].get(s, {}).get("cpu_ms_per_req")
            row[s] = None if cpu is None or floor is None else cpu - floor
        for s in ("tito", "base"):
            per_round = []
            for r in rounds:
                try:
                    zero = r["inprocess"][wl.name]["cpu_ms_per_req"]
                    mine, theirs = r[s][wl.name]["cpu_ms_per_req"] - zero, r["vllm"][wl.name]["cpu_ms_per_req"] - zero
                except (KeyError, TypeError):
                    continue
                if theirs > 0:
                    per_round.append(mine / theirs)
            row[f"{s}_ratio"] = statistics.median(per_round) if per_round else None
            row[f"{s}_ratio_rounds"] = per_round
        out[wl.name] = row
    return out


def print_table(summary: dict[str, Any], systems: list[str], workloads: list[Workload], rounds: int) -> None:
    print(f"\nmedians over {rounds} round(s); errors are totals (non-200, error event, short answer)")
    print("cpu ms/req: CPU time of the serving process (API + engine client; not the EngineCore) per request;")
    print("client ms/req: CPU time of the HTTP load generator per request (taken from the same 2 cores)")
    head = (f"{'workload':<12} {'system':<10} {'tok/s':>9} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6} "
            f"{'cpu ms/req':>10} {'client ms/req':>13}")
    print(head)
    print("-" * len(head))
    for wl in workloads:
        row = summary["workloads"][wl.name]
        for s in systems:
            m = row[s]
            print(f"{wl.name:<12} {s:<10} {fmt(m['tok_s']):>9} {fmt(m['req_s'], 1):>9} {fmt(m['p50_ms'], 2):>8} "
                  f"{fmt(m['p99_ms'], 2):>8} {m['errors']:>6} {fmt(m.get('cpu_ms_per_req'), 3):>10} "
                  f"{fmt(m.get('client_cpu_ms_per_req'), 3):>13}")
        ratios = []
        for other in ("inprocess", "vllm", "matched"):
            if row.get(f"tito/{other}") is not None:
                burned = f", {row[other]['burned_cores']:.2f} cores burned" if other == "matched" else ""
                ratios.append(f"tito/{other} {row[f'tito/{other}']:.2f} ({wl.metric}{burned})")
            if row.get(f"tito-{other}_p50_ms") is not None:
                ratios.append(f"tito-{other} p50 {row[f'tito-{other}_p50_ms']:+.2f} ms")
        if ratios:
            print(f"{'':<12} {'':<10} " + "; ".join(ratios))
    added = summary.get("added") or {}
    if added:
        print("\nserving-process CPU ms/req above the in-process engine client (the same work, the output kind a server"
              "\nasks for); ratio = the server's added / vLLM's server's added (median of per-round ratios; goal"
              " <= 0.25);\nthroughput: tito over vLLM's server (p50 latency: vLLM's over tito's, so > 1 is tito ahead)")
        servers = [s for s in ("tito", "base") if s in systems]
        print(f"{'workload':<12} {'in-process':>10} " + " ".join(f"{s:>8}" for s in [*servers, "vllm"]) + " "
              + " ".join(f"{s + ' adds':>9}" for s in [*servers, "vllm"]) + " "
              + " ".join(f"{s + ' ratio':>10}" for s in servers) + f" {'tito/vLLM thr.':>14}")
        for wl in workloads:
            a, row = added[wl.name], summary["workloads"][wl.name]
            key = {"tok/s": "tok_s", "req/s": "req_s", "p50": "p50_ms"}[wl.metric]
            thr = row.get("tito/vllm")
            if thr is None and row.get("tito", {}).get(key) and row.get("vllm", {}).get(key):
                thr = row["vllm"][key] / row["tito"][key]  # latency: lower is better, so vLLM's over tito's
            print(f"{wl.name:<12} {fmt(row['inprocess']['cpu_ms_per_req'], 2):>10} "
                  + " ".join(f"{fmt(row.get(s, {}).get('cpu_ms_per_req'), 2):>8}" for s in [*servers, "vllm"]) + " "
                  + " ".join(f"{fmt(a.get(s), 2):>9}" for s in [*servers, "vllm"]) + " "
                  + " ".join(f"{fmt(a.get(s + '_ratio'), 2):>10}" for s in servers) + f" {fmt(thr, 2):>14}")
    print_spread(summary, systems, workloads)
    print("\ncold-start errors (warm-up right after start):", summary["cold_errors"])
    print("peak memory MB: server process RSS (USS = its own, unshared share) / engine processes RSS:")
    for s, m in summary["memory"].items():
        if isinstance(m, dict):
            print(f"  {s:<10} {m['server_rss_mb']:8.0f} (USS {m['server_uss_mb']:6.0f}) / {m['engine_rss_mb']:8.0f}")
    if "tito_own_mb" in summary["memory"]:
        print(f"tito's own share (USS of tito's process minus USS of the in-process engine client): "
              f"{summary['memory']['tito_own_mb']:.0f} MB")


def _mmm(v: list[float] | None, nd: int) -> str:
    return "-" if not v else " / ".join(f"{x:,.{nd}f}" for x in v)


def print_spread(summary: dict[str, Any], systems: list[str], workloads: list[Workload]) -> None:
    """Each figure's min / median / max over rounds, and tito against base round by round."""
    print("\nspread over rounds (min / median / max): the workload's figure and the serving process's CPU ms/req")
    for wl in workloads:
        row = summary["workloads"][wl.name]
        key = {"tok/s": "tok_s", "req/s": "req_s", "p50": "p50_ms"}[wl.metric]
        nd = 2 if key == "p50_ms" else 0
        for s in systems:
            sp = row[s].get("spread") or {}
            print(f"{wl.name:<12} {s:<10} {wl.metric:>6} {_mmm(sp.get(key), nd):>28}   cpu ms/req "
                  f"{_mmm(sp.get('cpu_ms_per_req'), 3)}")
    if not any("ab" in summary["workloads"][wl.name] for wl in workloads):
        return
    print("\ntito (this tree) against base, per round (min / median / max): tito/base of the workload's figure "
          "(p50: lower is better), and tito - base of the serving process's CPU ms/req")
    for wl in workloads:
        ab = summary["workloads"][wl.name]["ab"]
        print(f"{wl.name:<12} {wl.metric:>6} ratio {_mmm(ab['ratio'], 3):>24}   cpu diff ms/req "
              f"{_mmm(ab['cpu_diff_ms'], 3):>26}   ({ab['rounds']} rounds)")


def write_chart(path: Path, summary: dict[str, Any], systems: list[str], workloads: list[Workload]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart (pip install matplotlib)", file=sys.stderr)
        return False
    names = [w.name for w in workloads]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(len(systems), 1)
    for k, s in enumerate(systems):
        xs = [i + k * width for i in range(len(names))]
        tps = [summary["workloads"][n][s]["tok_s"] or 0 for n in names]
        p50 = [summary["workloads"][n][s]["p50_ms"] or 0 for n in names]
        ax1.bar(xs, tps, width, label=s)
        ax2.bar(xs, p50, width, label=s)
    for ax, title, unit in ((ax1, "throughput", "generated tokens/s"), (ax2, "latency p50", "ms")):
        ax.set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(names))], names)
        ax.set_title(title)
        ax.set_ylabel(unit)
        ax.legend()
    ax2.set_yscale("log")
    fig.suptitle("tito benchmark (medians over rounds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

