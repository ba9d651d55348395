"""What a replica last committed, kept on disk under ``--state-dir`` so a restarted replica comes back at that version
(never silently at ``--model``'s weights while the rest of its fleet serves step N).

The record (``weights.json``, written atomically: temporary file, fsync, rename, fsync of the directory) names the
served weight version and where the weights came from:

- ``base``: the model's own checkpoint (at start, after ``/reload_weights``);
- ``checkpoint``: a weight directory (``/update_weights {"weight_dir"}``, a staged full version given by path) with
  its fingerprint (names, sizes, mtimes): a directory rewritten since is not the committed version. A staged full
  version that tito holds itself (an upload, kept in the staging directory, which is removed at exit) is first copied
  (hard-linked when on the same file system) under the state directory;
- ``deltas``: the staged deltas committed on top of that base, in order, each copied under the state directory
  (a delta is small: the changed elements only);
- ``unrestorable``: a broadcast or vLLM's native weight transfer. The received tensors exist only in the engine's
  memory; tito does not copy the model to disk on every step (seconds of I/O per update at a real model's size), so a
  replica restarted after such an update refuses to serve until it gets weights again (an update, a commit, or
  ``/reload_weights`` to accept the base weights on purpose).

``restore`` (app/weights/restore.py) reads it at start, before the replica reports ready or joins discovery. A record
whose files are gone or changed keeps the replica not ready (``/ready`` reason ``weights_not_restored``, generate 503),
never a fall-back to the base weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from app.weights.stage_uploads import remove_tree, safe_component

log = logging.getLogger("tito.weights")

RECORD = "weights.json"
SCHEMA = 1


def default_state_dir(model: str, port: int) -> Path:
    """``$XDG_STATE_HOME/tito/<port>-<hash of the model path>`` (``~/.local/state`` when unset): the same command line
    finds the same record; another model or port starts a record of its own."""
    root = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    key = hashlib.sha256(str(Path(model).resolve()).encode()).hexdigest()[:12]
    return root / "tito" / f"{port}-{key}"


def resolve_state_dir(setting: str | None, model: str, port: int, default: bool = True) -> Path | None:
    """``--state-dir``: a directory, ``off`` (no record: a restart serves the base weights), unset: the default
    (``default=False``: none; an app built around an injected engine, in tests, records only when asked to)."""
    if setting is not None and setting.strip().lower() in ("off", "none", ""):
        return None
    if setting:
        return Path(setting)
    return default_state_dir(model, port) if default else None


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` so that a crash leaves the old file or the new one, never a torn one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system (or links refused): a copy, mtime kept (it is in the fingerprint)
        shutil.copy2(src, dst)


class WeightRecord:
    """The record of one replica (``AppState.weights.recorder``). ``committed`` is called by the weight manager after
    every successful change of the served weights or of their version label."""

    def __init__(self, directory: Path, model: str, volatile: list[Path] | None = None) -> None:
        self.dir = directory
        self.model = str(Path(model).resolve())
        # Directories removed at exit (the staging directory): weights committed from there are copied first.
        self.volatile = list(volatile or [])
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = directory / RECORD
        self.suspended = False  # while the record itself is being restored: the record stays as it is
        self.error: str | None = None  # the last write's failure (shown in /server_info)
        self.restore_error: str | None = None  # set by the restore at start; cleared by the next committed update
        self.restored: dict[str, Any] | None = None
        self.written_at: float | None = None
        self._seq = int(time.time() * 1000)

    def read(self) -> dict[str, Any] | None:
        if not self.path.exists():
            return None
        rec = json.loads(self.path.read_text())
        if not isinstance(rec, dict) or rec.get("schema") != SCHEMA:
            raise ValueError(f"{self.path} is not a tito weight record of schema {SCHEMA}")
        return rec

    # ------------------------------------------------------------------ writing

    def committed(self, version: str, origin: dict[str, Any] | None, source: str) -> None:
        """Record the weights now served: ``origin`` is the weight manager's (app/weights/updates.py)."""
        if self.suspended:
            return
        try:
            rec = self._next(version, origin, source)
            write_atomic(self.path, json.dumps(rec, indent=1).encode())
            self._collect(rec)
            self.error, self.restore_error, self.written_at = None, None, time.time()
        except Exception as e:  # noqa: BLE001 - the update happened; say loudly that a restart would not find it
            self.error = f"{type(e).__name__}: {e}"
            log.error("could not write the weight record %s: %s (a restart would not come back at version %s)",
                      self.path, self.error, version)

    def relabel(self, version: str) -> None:
        """A new version label on the same weights (``/update_weight_version``)."""
        if self.suspended:
            return
        try:
            rec = self.read() or self._base_record("default")
            rec["weight_version"] = version
            rec["committed_at"] = time.time()
            write_atomic(self.path, json.dumps(rec, indent=1).encode())
            self.error = None
        except Exception as e:  # noqa: BLE001
            self.error = f"{type(e).__name__}: {e}"
            log.error("could not write the weight record %s: %s", self.path, self.error)

    def _base_record(self, version: str) -> dict[str, Any]:
        return {"schema": SCHEMA, "model": self.model, "weight_version": version, "weights": {"kind": "base"},
                "deltas": [], "committed_at": time.time()}

    def _next(self, version: str, origin: dict[str, Any] | None, source: str) -> dict[str, Any]:
        rec = self._base_record(version)
        kind = (origin or {}).get("kind")
        if origin is None:
            rec["weights"] = {"kind": "unrestorable", "source": source}
        elif kind == "base":
            pass
        elif kind == "checkpoint":
            rec["weights"] = {"kind": "checkpoint", **self._keep_dir(Path(origin["dir"]), version),
                              "fingerprint": origin.get("fingerprint")}
        elif kind == "delta":
            prev = self.read()
            if prev is None or prev["weights"].get("kind") == "unrestorable":
                raise ValueError("a delta was committed on weights the record does not hold")
            artifact = Path(origin["artifact"])
            self._seq += 1
            keep = self.dir / "deltas" / f"{self._seq}-{safe_component(version)}{''.join(artifact.suffixes[-1:])}"
            keep.parent.mkdir(parents=True, exist_ok=True)
            _link_or_copy(artifact, keep)
            rec["weights"] = prev["weights"]
            rec["deltas"] = [*prev.get("deltas", []), {"version": version, "base_version": origin.get("base_version"),
                                                        "file": str(keep), "sha256": origin.get("sha256")}]
        else:
            raise ValueError(f"unknown weight origin {kind!r}")
        return rec

    def _keep_dir(self, directory: Path, version: str) -> dict[str, Any]:
        """The directory to record: ``directory`` itself, or a copy under the state directory when it lies in one
        that goes away at exit."""
        d = directory.resolve()
        if not any(d.is_relative_to(v.resolve()) for v in self.volatile):
            return {"dir": str(d)}
        self._seq += 1
        keep = self.dir / "versions" / f"{self._seq}-{safe_component(version)}"
        keep.mkdir(parents=True)
        for f in d.iterdir():
            if f.is_file():
                _link_or_copy(f, keep / f.name)
        return {"dir": str(keep), "copied_from": str(d)}

    def _collect(self, rec: dict[str, Any]) -> None:
        """Remove the copies the record no longer names."""
        named = {str(Path(rec["weights"].get("dir", "/nonexistent")))} | {d["file"] for d in rec.get("deltas", [])}
        for sub in ("versions", "deltas"):
            d = self.dir / sub
            if d.is_dir():
                for p in d.iterdir():
                    if str(p) not in named:
                        remove_tree(p)

    # ------------------------------------------------------------------ reporting

    def info(self) -> dict[str, Any]:
        try:
            rec = self.read()
        except Exception as e:  # noqa: BLE001 - the info route must answer
            rec = {"error": str(e)}
        return {"state_dir": str(self.dir), "record": rec, "restored": self.restored,
                "restore_error": self.restore_error, "write_error": self.error}
