"""What the board (app/server/board.py) carries: the server-wide state an API process of several serves from
without asking the control process (``board_doc``, written by the control process), and how an API process takes it
as its own (``apply_board``). app/server/api_processes.py says when each is called."""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

from app.server.state import AppState

log = logging.getLogger("tito.api")


def board_doc(state: AppState | None, extra: dict[str, Any]) -> dict[str, Any]:
    """The server-wide state every API process reads (the control process's ``state``; None while it starts)."""
    doc = dict(extra)
    if state is None:
        return doc
    w, eng = state.weights, state.engine
    doc.update({
        "ready": state.ready, "draining": state.draining, "drain_started_at": state.drain_started_at,
        "shutting_down": state.shutting_down, "leaving": state.leaving, "started_at": state.started_at,
        "engine_dead": eng.errored, "engine_failure": state.engine_failure if eng.errored else None,
        "inconsistent": asdict(w.inconsistent) if w.inconsistent is not None else None,
        "restore_error": state.restore_error, "weight_version": w.version,
        "paused": eng.paused_record, "cache_epoch": eng.cache_epoch,
        "loras": [{"name": e.name, "int_id": e.int_id, "path": e.path, "loaded_at": e.loaded_at, "rank": e.rank,
                   "alpha": e.alpha, "target_modules": e.target_modules, "reloads": e.reloads}
                  for e in state.adapters.entries.values()],
    })
    return doc


def apply_board(state: AppState, doc: dict[str, Any]) -> None:
    """An API process takes the control process's word for the server-wide state."""
    from app.weights.lora import LoraEntry
    from app.weights.updates import Inconsistent

    if "ready" not in doc:
        return
    state.ready, state.draining, state.drain_started_at = doc["ready"], doc["draining"], doc["drain_started_at"]
    state.shutting_down, state.leaving, state.started_at = doc["shutting_down"], doc["leaving"], doc["started_at"]
    if doc["engine_dead"]:
        state.engine_failure = doc["engine_failure"]
        if not state.engine.errored:
            log.error("engine is dead: %s", (doc["engine_failure"] or {}).get("cause"))
            state.engine.mark_dead()  # its requests here end now, as the control process's did
    bad = doc["inconsistent"]
    state.weights.inconsistent = Inconsistent(**bad) if bad else None
    state._restore_error = doc["restore_error"]
    state.weights.version = doc["weight_version"]
    state.engine.assume_paused(doc["paused"])
    state.engine.cache_epoch = doc["cache_epoch"]
    entries = state.adapters.entries  # updated in place: vLLM's OpenAI layer holds this dict
    wanted = {e["name"]: e for e in doc["loras"]}
    for name in [n for n in entries if n not in wanted]:
        del entries[name]
    for name, e in wanted.items():
        have = entries.get(name)
        if have is None or (have.int_id, have.path, have.reloads) != (e["int_id"], e["path"], e["reloads"]):
            entries[name] = LoraEntry(handle=state.engine.lora_request(name, e["int_id"], e["path"]), **e)
