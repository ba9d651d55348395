"""A staged delta read, checked against the active weights and written in tito's prepared form (``prepare_delta``),
in a process of its own (``in_process``).

Reading and checking a delta is CPU work in Python and numpy. In a thread it would hold the GIL the event loop (and so
every token stream) needs. The process runs at the engine's priority: the stage answers only once the delta is
checked (and the workers have it ready), and at a lower priority a busy engine starved it (at nice 10, 3-19 s for a
60 MB delta while two streams generated on two cores, against well under a second idle).
"""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

from app.core.protocol import ApiError
from app.engine.delta_format import DeltaFormatError, DeltaRecord, StreamWriter, check_against, iter_delta
from app.weights.tied import tied_heads
from app.weights.updates import TensorInfo, is_buffer

_PROCESS: ProcessPoolExecutor | None = None  # started on first use


async def in_process(fn: Callable[..., Any], *args: Any, timeout: float) -> Any:
    """Run ``fn(*args)`` (a module-level function, picklable arguments) in the staging process; past
    ``timeout`` seconds the process is killed (the next call starts another) and the caller gets a 504."""
    global _PROCESS
    if _PROCESS is None:
        _PROCESS = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    pool = _PROCESS
    try:
        return await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(pool, fn, *args), timeout)
    except BrokenProcessPool:
        _PROCESS = None  # the process died (killed, out of memory): the next stage starts another
        raise ApiError(503, "the staging process died; retry the stage.", headers={"Retry-After": "1"}) from None
    except TimeoutError:
        _PROCESS = None
        _kill(pool)
        raise ApiError(504, f"checking the delta took over {timeout:g}s (--stage-timeout); retry the stage.") \
            from None


def stop_process() -> None:
    """At shutdown, the staging process is killed, not joined: it holds nothing to keep (a stage in flight fails with
    the server), and on a busy machine it took longer to leave than the server waits for its exit handlers (it
    outlived the server)."""
    global _PROCESS
    pool, _PROCESS = _PROCESS, None
    if pool is not None:
        _kill(pool)


def _kill(pool: ProcessPoolExecutor) -> None:
    for proc in list((pool._processes or {}).values()):  # the executor offers no way to stop a running call
        proc.kill()
    pool.shutdown(wait=False, cancel_futures=True)


def _digest(rec: DeltaRecord) -> str:
    import hashlib

    return hashlib.sha256(rec.indices.numpy().tobytes() + rec.values.double().numpy().tobytes()).hexdigest()


def prepare_delta(artifact: Path, out: Path, expected: dict[str, TensorInfo],
                  tied_to: str | None = None) -> tuple[int, int]:
    """Read every record of the delta, check it against the active weights, write the prepared form. Blocking.
    ``tied_to``: the embedding a tied model's head is; a record for the head must change it exactly as the
    embedding's record does (app/weights/tied.py), and is dropped."""
    tensors = elements = 0
    tied: dict[str, str] = {}  # name -> digest of its record, for a tied head and its embedding
    try:
        with StreamWriter(out) as w:
            for rec in iter_delta(artifact):
                info = expected.get(rec.name)
                if rec.name == tied_to or (tied_to is not None and info is None and rec.name in tied_heads(
                        [rec.name], expected, tied_to)):
                    tied[rec.name] = _digest(rec)
                if info is None:
                    if is_buffer(rec.name) or rec.name in tied:
                        continue
                    raise DeltaFormatError(f"the model has no tensor {rec.name!r}.")
                check_against(rec, info.shape, info.dtype)
                w.write(rec)
                tensors += 1
                elements += rec.indices.numel()
            for head in (n for n in tied if n != tied_to):
                if tied[head] != tied.get(str(tied_to)):
                    raise DeltaFormatError(f"{head!r} changes differently from {tied_to!r}: the model ties its head "
                                           "to the embedding (tie_word_embeddings).")
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    return tensors, elements
