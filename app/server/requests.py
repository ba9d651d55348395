"""What every generation surface does with a request besides generating: the data-parallel rank it pins
(``data_parallel_rank``: HTTP's ``X-data-parallel-rank`` header, gRPC's field or metadata) and watching its client
leave while it runs (``Disconnect``, for the ASGI routes: gRPC cancels the call's task itself)."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.types import Receive

from app.core.protocol import bad_request

DP_RANK_HEADER = "X-data-parallel-rank"


def data_parallel_rank(raw: str | int | None, dp_size: int, name: str = DP_RANK_HEADER) -> int | None:
    """The engine core a request is pinned to (None: any); ``name`` is what the caller sent it as. A rank that is
    not an integer in [0, dp_size) is a 400 (vLLM ignores a bad header; tito says so)."""
    if raw is None:
        return None
    try:
        rank = int(raw)
    except ValueError:
        raise bad_request(f"{name} must be an integer, got {raw!r}.", name) from None
    if not 0 <= rank < dp_size:
        raise bad_request(f"{name} {rank} is out of range [0, {dp_size}).", name)
    return rank


class Disconnect:
    """While the current task serves a request, one watcher task listens for the client going away
    (``http.disconnect``) and then cancels it. The task catches the ``CancelledError`` and asks ``left()`` whether it
    was the client (then it goes on to clean up) or the server shutting down (re-raise).

    One watcher per request, not a collector and a watcher joined with ``asyncio.wait``: a task, a wait set and a
    wake-up less on every request."""

    __slots__ = ("task", "gone", "ending", "watcher")

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.task: asyncio.Task[Any] = task
        self.gone = False
        self.ending = False  # set once the answer is complete: the disconnect its end reports is not a leave
        self.watcher = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self.ending:
            self.gone = True
            self.task.cancel()

    def left(self) -> bool:
        """After a cancellation (or once the work is done): whether the client left; if so the cancellation is taken
        back, so ask once."""
        if self.gone:
            self.task.uncancel()
        return self.gone

    def stop(self) -> None:
        """No await since the work ended: the watcher cannot cancel the task after this."""
        self.ending = True
        self.watcher.cancel()
