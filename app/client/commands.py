"""``tito``'s client commands for a running server (``generate``, ``status``, ``drain``/``undrain``,
``update-weights``, ``load-lora``/``unload-lora``, ``pause``/``resume``).

They talk to the server through ``app.client.clients`` (httpx only: no vLLM or torch import, so they start fast).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000"


def _add_client_flags(p: argparse.ArgumentParser, timeout: float = 300.0) -> None:
    import os

    p.add_argument("--url", default=os.environ.get("TITO_URL", DEFAULT_URL),
                   help=f"Server URL [env TITO_URL; default {DEFAULT_URL}]. A trailing /v1 is ignored.")
    p.add_argument("--api-key", default=None, help="Data-plane Bearer key [env TITO_API_KEY].")
    p.add_argument("--admin-api-key", default=None,
                   help="Admin-plane Bearer key [env TITO_ADMIN_API_KEY; default: the --api-key].")
    p.add_argument("--timeout", type=float, default=timeout,
                   help=f"Seconds to wait for the answer (default {timeout:g}).")


def _client(ns: argparse.Namespace) -> Any:
    import os

    from app.client.clients import TitoClient

    return TitoClient(ns.url, api_key=ns.api_key or os.environ.get("TITO_API_KEY"),
                      admin_api_key=ns.admin_api_key or os.environ.get("TITO_ADMIN_API_KEY"), timeout=ns.timeout)


def _fail(e: Exception) -> int:
    print(f"tito: {e}", file=sys.stderr)
    return 1


def _progress(label: str, work: Callable[[], Any], status: Callable[[], str] | None = None,
              every: float = 0.5) -> tuple[Any, float]:
    """Run ``work`` in a thread and show ``label``, elapsed seconds and ``status()`` on stderr while it runs.

    On a terminal the line is redrawn in place; otherwise a line is written every 5 s (logs stay readable).
    Returns (result, elapsed seconds); re-raises what ``work`` raised.
    """
    import threading
    import time

    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = work()
        except BaseException as e:  # noqa: BLE001 - handed back to the caller's thread
            box["error"] = e

    t0 = time.monotonic()
    th = threading.Thread(target=run, daemon=True)
    th.start()
    tty = sys.stderr.isatty()
    if not tty:
        print(f"{label} ...", file=sys.stderr, flush=True)
    last_line = t0
    while True:
        th.join(every)
        elapsed = time.monotonic() - t0
        if not th.is_alive():
            break
        extra = ""
        if status is not None:
            try:
                extra = status()
            except Exception as e:  # noqa: BLE001 - progress is best effort
                extra = f"({type(e).__name__})"
        if tty:
            print(f"\r\033[K{label} ... {elapsed:.1f}s {extra}", end="", file=sys.stderr, flush=True)
        elif time.monotonic() - last_line >= 5.0:
            print(f"{label} ... {elapsed:.0f}s {extra}", file=sys.stderr, flush=True)
            last_line = time.monotonic()
    if tty:
        print("\r\033[K", end="", file=sys.stderr, flush=True)
    if "error" in box:
        raise box["error"]
    return box.get("result"), elapsed


def _parse_tokens(raw: str) -> list[int]:
    try:
        toks = [int(x) for x in raw.replace(" ", ",").split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"tito: --tokens must be comma-separated integers, got {raw!r}") from None
    if not toks:
        raise SystemExit("tito: --tokens is empty")
    return toks


def cmd_generate(ns: argparse.Namespace) -> int:
    import json
    import time

    from app.client.clients import TitoError

    tokens = _parse_tokens(ns.tokens)
    sp: dict[str, Any] = {"max_tokens": ns.max_tokens}
    for k in ("temperature", "top_p", "top_k", "seed"):
        if getattr(ns, k) is not None:
            sp[k] = getattr(ns, k)
    if ns.logprobs:
        sp["logprobs"] = ns.top_logprobs
    if ns.ignore_eos:
        sp["ignore_eos"] = True
    t0 = time.monotonic()
    try:
        with _client(ns) as c:
            if ns.stream:
                n = 0
                finish = None
                for d in c.generate_stream(tokens, sp, model=ns.model, images=ns.image):
                    if d.index < 0:
                        continue
                    lps = d.logprobs or [None] * len(d.token_ids)
                    for tid, lp in zip(d.token_ids, lps, strict=False):
                        if ns.logprobs:
                            print(f"{tid}\t{lp:.6f}" if lp is not None else f"{tid}\t-", flush=True)
                        else:
                            print(("" if n == 0 else " ") + str(tid), end="", flush=True)
                        n += 1
                    finish = d.finish_reason or finish
                if not ns.logprobs:
                    print(flush=True)
                print(f"finish_reason={finish} tokens={n} time={(time.monotonic() - t0) * 1000:.1f}ms",
                      file=sys.stderr)
                return 0
            out = c.generate(tokens, sp, model=ns.model, images=ns.image)
    except TitoError as e:
        return _fail(e)
    if ns.json:
        print(json.dumps(out.raw, indent=2))
        return 0
    for ch in out.choices:
        if ns.logprobs:
            lps = ch.logprobs or [None] * len(ch.token_ids)
            for tid, lp in zip(ch.token_ids, lps, strict=False):
                print(f"{tid}\t{lp:.6f}" if lp is not None else f"{tid}\t-")
        else:
            print(" ".join(str(t) for t in ch.token_ids))
        print(f"finish_reason={ch.finish_reason} tokens={len(ch.token_ids)} "
              f"time={(time.monotonic() - t0) * 1000:.1f}ms", file=sys.stderr)
    return 0


def _first(d: Any, *keys: str) -> Any:
    """The first present, non-None value among dotted ``keys`` of nested dicts."""
    for key in keys:
        cur = d
        for part in key.split("."):
            cur = cur.get(part) if isinstance(cur, dict) else None
        if cur is not None:
            return cur
    return None


def _weights_from(rec: Any) -> str | None:
    """Where the served weights came from at start: the weight record (a restart restores the last committed
    version), or the model directory."""
    if not isinstance(rec, dict):
        return "the model directory (no weight record: --state-dir off)" if rec is None else None
    where = rec.get("state_dir")
    if rec.get("restore_error"):
        return f"restore FAILED from {where}: {rec['restore_error']}"
    restored = rec.get("restored")
    if isinstance(restored, dict):
        src = restored.get("weights") or {}
        what = src.get("dir") or src.get("kind") or "?"
        deltas = f" + {restored['deltas']} delta(s)" if restored.get("deltas") else ""
        return f"{restored.get('weight_version')} restored at start from {where} ({what}{deltas})"
    return f"the model directory at start (weight record: {where})"


def format_status(info: dict[str, Any]) -> str:
    """A readable summary of ``/server_info``: model, state, weight version, in-flight requests, adapters."""
    st = info.get("state") or {}
    model = _first(info, "model.served_model_name", "model.name")
    path = _first(info, "model.path")
    if st.get("engine") not in (None, "alive"):
        state = f"engine {st.get('engine')}" + (f": {st['engine_error']}" if st.get("engine_error") else "")
    else:
        flags = [k.replace("_", " ") for k in ("shutting_down", "draining", "paused") if st.get(k)]
        state = ", ".join(flags) or ("serving" if st.get("ready") else "starting")
    adapters = st.get("loaded_adapters") or []
    names = [a.get("lora_name") or a.get("name") if isinstance(a, dict) else str(a) for a in adapters]
    par = info.get("parallelism") or {}
    rows = [
        ("model", f"{model}" + (f" ({path})" if path and path != model else "")),
        ("state", state),
        ("weight version", st.get("weight_version")),
        ("weights from", _weights_from(st.get("weight_record"))),
        ("in flight", st.get("inflight")),
        ("adapters", ", ".join(str(n) for n in names) if names else "none"),
        ("max model len", _first(info, "model.max_model_len")),
        ("parallelism", f"dp={par.get('data_parallel_size')} tp={par.get('tensor_parallel_size')}"
         + (f" api={par['api_server_count']}" if (par.get("api_server_count") or 1) > 1 else "") if par else None),
        ("processes", _processes(info.get("api_processes"))),
        ("versions", " ".join(f"{k} {v}" for k, v in (("tito", _first(info, "server.version")),
                                                      ("vLLM", _first(info, "server.vllm_version"))) if v)),
        ("uptime", f"{_first(info, 'server.uptime_s'):.0f}s" if _first(info, "server.uptime_s") is not None else None),
    ]
    width = max(len(k) for k, _ in rows)
    indent = "\n" + " " * (width + 2)  # a value of several lines (the processes) keeps its column
    return "\n".join(f"{k:<{width}}  {str(v).replace(chr(10), indent)}" for k, v in rows if v not in (None, ""))


def _processes(rows: Any) -> str | None:
    """``--api-server-count`` > 1: each process, one per line (``/server_info``'s ``api_processes``)."""
    if not rows:
        return None
    lines = []
    for r in rows:
        name = f"api {r.get('index')}" if r.get("role") == "api" else str(r.get("role"))
        health = "" if r.get("alive", True) else " (gone)"
        lines.append(f"{name} pid {r.get('pid')}{health}: {r.get('inflight', 0)} in flight, "
                     f"{r.get('admitted', 0)} admitted, {r.get('forwarded', 0)} control calls forwarded")
    return "\n".join(lines)


def cmd_status(ns: argparse.Namespace) -> int:
    import json

    from app.client.clients import TitoError

    try:
        with _client(ns) as c:
            info = c.server_info()
    except TitoError as e:
        return _fail(e)
    print(json.dumps(info, indent=2) if ns.json else format_status(info))
    return 0


def cmd_drain(ns: argparse.Namespace) -> int:
    import json

    from app.client.clients import TitoError

    try:
        with _client(ns) as c, _client(ns) as poller:
            def status() -> str:
                s = poller.drain_status()
                n = _first(s, "inflight", "in_flight")
                return f"{n} in flight" if n is not None else ""

            out, elapsed = _progress(f"draining {ns.url}", lambda: c.drain(ns.drain_timeout), status)
    except TitoError as e:
        return _fail(e)
    drained = isinstance(out, dict) and out.get("status") == "drained"
    what = "drained" if drained else "still draining (timeout)"
    print(f"{what} in {elapsed:.2f}s: {json.dumps(out)}")
    return 0 if drained else 1


def _one_call(ns: argparse.Namespace, call: Callable[[Any], Any], done: Callable[[str, float], str],
              label: str | None = None) -> int:
    """The admin commands' shape: one client call, then ``done(<the answer as JSON>, seconds)`` printed; with
    ``label``, a progress line on stderr while it runs. A server error is printed and exits 1."""
    import json

    from app.client.clients import TitoError

    try:
        with _client(ns) as c:
            out, elapsed = _progress(label, lambda: call(c)) if label is not None else (call(c), 0.0)
    except TitoError as e:
        return _fail(e)
    print(done(json.dumps(out), elapsed))
    return 0


def cmd_undrain(ns: argparse.Namespace) -> int:
    return _one_call(ns, lambda c: c.undrain(), lambda out, _: f"undrain: {out}")


def cmd_update_weights(ns: argparse.Namespace) -> int:
    import os

    # The server resolves the path, so send an absolute one (relative to where the CLI runs, as the user means it).
    weight_dir = os.path.abspath(ns.dir)
    return _one_call(ns, lambda c: c.update_weights(weight_dir, ns.weight_version, timeout=ns.timeout),
                     lambda out, s: f"weights updated from {weight_dir} in {s:.2f}s: {out}",
                     f"updating weights from {weight_dir}")


def cmd_load_lora(ns: argparse.Namespace) -> int:
    import os

    path = os.path.abspath(ns.dir)
    return _one_call(ns, lambda c: c.load_lora(ns.name, path),
                     lambda out, s: f"adapter {ns.name} loaded from {path} in {s:.2f}s: {out}",
                     f"loading adapter {ns.name} from {path}")


def cmd_unload_lora(ns: argparse.Namespace) -> int:
    return _one_call(ns, lambda c: c.unload_lora(ns.name), lambda out, _: f"adapter {ns.name} unloaded: {out}")


def cmd_pause(ns: argparse.Namespace) -> int:
    return _one_call(ns, lambda c: c.pause(ns.mode, ns.clear_cache), lambda out, s: f"paused in {s:.2f}s: {out}",
                     f"pausing ({ns.mode})")


def cmd_resume(ns: argparse.Namespace) -> int:
    return _one_call(ns, lambda c: c.resume(), lambda out, _: f"resumed: {out}")


def _arg(*flags: str, **kw: Any) -> tuple[tuple[str, ...], dict[str, Any]]:
    """One argument of a command, as ``add_argument`` takes it."""
    return flags, kw


def _command(sub: Any, name: str, func: Callable[[argparse.Namespace], int], timeout: float, summary: str,
             description: str, *args: tuple[tuple[str, ...], dict[str, Any]]) -> None:
    """One client command: its parser, its own arguments, then the connection flags (``timeout``: its default)."""
    p = sub.add_parser(name, help=summary, description=description)
    for flags, kw in args:
        p.add_argument(*flags, **kw)
    _add_client_flags(p, timeout=timeout)
    p.set_defaults(func=func)


def add_client_commands(sub: Any) -> None:
    _command(sub, "generate", cmd_generate, 600.0, "Generate from token ids and print the new token ids.",
             "POST /inference/v1/generate and print the generated token ids (space-separated on one line; with "
             "--logprobs one 'id<TAB>logprob' line per token). Timing goes to stderr.",
             _arg("--tokens", required=True, help="Prompt token ids, comma-separated, e.g. 1,2,3."),
             _arg("--max-tokens", type=int, default=16, help="Tokens to generate (default 16)."),
             _arg("--temperature", type=float, default=None, help="Sampling temperature (0 = greedy)."),
             _arg("--top-p", type=float, default=None, help="Nucleus sampling p."),
             _arg("--top-k", type=int, default=None, help="Top-k sampling (-1 = off)."),
             _arg("--seed", type=int, default=None, help="Per-request sampling seed."),
             _arg("--ignore-eos", action="store_true", help="Keep generating past the EOS token."),
             _arg("--model", default=None, help="Model or LoRA adapter name (default: the base model)."),
             _arg("--stream", action="store_true", help="Stream: print tokens as they arrive."),
             _arg("--logprobs", action="store_true", help="Also print each token's logprob."),
             _arg("--top-logprobs", type=int, default=1, help="Candidates per position with --logprobs (default 1)."),
             _arg("--json", action="store_true", help="Print the server's whole JSON answer (not with --stream)."),
             _arg("--image", action="append", default=None, metavar="PATH",
                  help="Image file sent inline as a data URL (repeatable; multimodal models). --tokens then hold "
                  "one image token per image, e.g. from the chat template."))
    _command(sub, "status", cmd_status, 30.0, "Summarize a running server (GET /server_info).",
             "Print model, state, weight version, requests in flight and loaded adapters from GET /server_info.",
             _arg("--json", action="store_true", help="Print the raw JSON instead."))
    _command(sub, "drain", cmd_drain, 900.0,
             "Stop taking new generations and wait for in-flight ones (POST /drain).",
             "POST /drain: the server refuses new generate requests (503) and this waits until the requests in "
             "flight finish, showing progress. Exit code 1 if some were still running at the timeout. Undo with "
             "`tito undrain`.",
             _arg("--drain-timeout", type=float, default=None,
                  help="Seconds the server waits for in-flight requests (default: the server's)."))
    _command(sub, "undrain", cmd_undrain, 30.0, "Take new generations again (DELETE /drain).",
             "DELETE /drain: leave the draining state.")
    _command(sub, "update-weights", cmd_update_weights, 720.0,
             "Load new weights from a directory (POST /update_weights).",
             "POST /update_weights with DIR (HF safetensors, e.g. a trainer's broadcast step directory). Shows "
             "progress and the elapsed time.",
             _arg("dir", help="Weight directory (sent as an absolute path; must be under an allowed weight root)."),
             _arg("--weight-version", default=None, help="Version label for the new weights."))
    _command(sub, "load-lora", cmd_load_lora, 120.0, "Load or reload a LoRA adapter (POST /load_lora_adapter).",
             "POST /load_lora_adapter: load the PEFT adapter in DIR under NAME; loading the same NAME again replaces "
             "its weights in place. Requests then use it with model=NAME.",
             _arg("name", help="Adapter name."),
             _arg("dir", help="Adapter directory (adapter_config.json + adapter_model.safetensors)."))
    _command(sub, "unload-lora", cmd_unload_lora, 60.0, "Unload a LoRA adapter (POST /v1/unload_lora_adapter).",
             "POST /v1/unload_lora_adapter for NAME.",
             _arg("name", help="Adapter name."))
    _command(sub, "pause", cmd_pause, 300.0, "Pause generation (POST /pause).",
             "POST /pause: keep parks in-flight requests (they continue on resume), wait lets them finish, abort "
             "ends them.",
             _arg("--mode", choices=("keep", "wait", "abort"), default="keep", help="Pause mode (default keep)."),
             _arg("--clear-cache", action="store_true", help="Also clear the prefix cache."))
    _command(sub, "resume", cmd_resume, 60.0, "Resume generation (POST /resume).", "POST /resume.")
