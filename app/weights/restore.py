"""Restore at start what the weight record (app/weights/record.py) says this replica last committed, before it reports
ready or joins discovery. Any failure leaves ``recorder.restore_error`` set: the replica stays not ready (generate
503) until an update succeeds; it never serves the base weights in place of the recorded version."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from app.core.protocol import ApiError
from app.weights.record import WeightRecord
from app.weights.staging import StagingManager
from app.weights.tied import check_checkpoint
from app.weights.updates import UpdateOutcome, WeightManager, scan_checkpoint

log = logging.getLogger("tito.weights")


class RestoreError(Exception):
    pass


async def load_checkpoint_dir(weights: WeightManager, directory: Path, version: str, source: str,
                              fingerprint: str | None = None, kind: str = "checkpoint") -> UpdateOutcome:
    """Validate and load the checkpoint in ``directory`` as ``version`` (the disk update's path, without a route)."""
    ck = await asyncio.to_thread(scan_checkpoint, directory)
    if fingerprint is not None and ck.fingerprint != fingerprint:
        raise RestoreError(f"the checkpoint {directory} changed on disk since it was committed (files, sizes or "
                           "mtimes differ)")
    check = await asyncio.to_thread(check_checkpoint, ck, await weights.expected(), weights.model_dir)

    async def load() -> list[Any]:
        return await weights.engine.load_checkpoint([str(f) for f in ck.files], check.skipped)

    origin = {"kind": kind, "dir": str(directory), "files": [str(f) for f in ck.files],
              "fingerprint": ck.fingerprint}
    return await weights.run(None, lambda: weights.apply(source, load, version, ck.total_bytes,
                                                         f"restoring weights from {directory}", origin))


async def _restore(rec: dict[str, Any], weights: WeightManager, staging: StagingManager, model: str) -> None:
    if rec.get("model") != model:
        raise RestoreError(f"the record is for the model {rec.get('model')!r}, this server serves {model!r}")
    src = rec["weights"]
    kind = src.get("kind")
    deltas = rec.get("deltas", [])
    version = str(rec["weight_version"])
    if kind == "unrestorable":
        raise RestoreError(f"version {version!r} came from a {src.get('source')} update: tito keeps no copy of "
                           "weights received over the network. Send this replica the current weights "
                           "(/update_weights, a staged commit), or POST /reload_weights to serve the base weights on "
                           "purpose")
    # A delta's version or the final label; the base keeps the label its first delta was committed on.
    base_label = str(deltas[0]["base_version"]) if deltas else version
    if kind == "checkpoint":
        directory = Path(src["dir"])
        if not directory.is_dir():
            raise RestoreError(f"the committed checkpoint {directory} is gone")
        await load_checkpoint_dir(weights, directory, base_label if deltas else version, "restore",
                                  src.get("fingerprint"))
    elif kind != "base":
        raise RestoreError(f"unknown weight source {kind!r} in the record")
    for d in deltas:
        f = Path(d["file"])
        if not f.is_file():
            raise RestoreError(f"the committed delta {d['version']} ({f}) is gone")
        await staging.register_delta(str(d["version"]), staging.active_version, f, "restore", str(f), None,
                                     d.get("sha256"))
        entry = staging.lookup(str(d["version"]), "delta")
        if entry is not None:
            await staging.commit_delta(entry)
    if weights.version != version:
        await weights.engine.set_weight_version(version)
        weights.version = version


async def restore(weights: WeightManager, staging: StagingManager, recorder: WeightRecord) -> None:
    """Bring the engine to the recorded weights; on failure set ``recorder.restore_error`` (logged)."""
    t0 = time.monotonic()
    try:
        rec = recorder.read()
    except Exception as e:  # noqa: BLE001 - an unreadable record is a failed restore, not "no record"
        recorder.restore_error = f"the weight record {recorder.path} is unreadable: {e}"
        log.error("%s; not ready until weights are sent", recorder.restore_error)
        return
    if rec is None:
        log.info("no weight record in %s: serving the base weights", recorder.dir)
        return
    recorder.suspended = True
    try:
        await _restore(rec, weights, staging, recorder.model)
    except (RestoreError, ApiError, OSError, KeyError, ValueError) as e:
        msg = e.message if isinstance(e, ApiError) else str(e)
        recorder.restore_error = f"could not restore version {rec.get('weight_version')!r} from {recorder.path}: {msg}"
        log.error("%s; this replica stays not ready (out of discovery) until it gets weights", recorder.restore_error)
        return
    finally:
        recorder.suspended = False
    recorder.restored = {"weight_version": weights.version, "seconds": round(time.monotonic() - t0, 3),
                         "weights": rec["weights"], "deltas": len(rec.get("deltas", []))}
    log.info("restored weight version %s from %s in %.2fs (%s + %d delta(s))", weights.version, recorder.path,
             time.monotonic() - t0, rec["weights"].get("kind"), len(rec.get("deltas", [])))
