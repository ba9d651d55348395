"""Shared memory between the processes of one server (``tito serve --api-server-count N``, N > 1): what every API
process reads of the server-wide state without asking anyone, and counters each process keeps for the others.

One anonymous shared mapping, made by the control process before it forks the API processes (they inherit it):

- the board: the server-wide state (app/server/mirror.py says what is on it) as one JSON document, with a
  sequence number and a checksum. Only the control process writes it; an API process compares the sequence number
  with the last one it read on every admission (one load from memory) and reads the document again only when it
  moved. The writer makes the number odd while it writes and the reader retries on an odd number, a moved one or a
  checksum that does not match: no lock a dying process could leave held, and no reliance on the order in which
  another CPU sees the stores.
- the slots: a row of counters per process (requests in flight, finished, admitted; control calls forwarded; the
  board it last read; its pid), each written only by its own process, read and summed by any.
- the loads: each API process's open connections, for vLLM's accept balancing (app/engine/api_servers.py).
"""

from __future__ import annotations

import ctypes
import json
import logging
import mmap
import threading
import time
import zlib
from typing import Any

log = logging.getLogger("tito.board")

# A slot's columns.
INFLIGHT, FINISHED, ADMITTED, FORWARDED, SEEN, PID, UP = range(7)
COLUMNS = 8
_HEADER = 4  # int64s: sequence number, length, checksum, spare
BOARD_BYTES = 4 << 20
NOT_ACCEPTING = 2**31 - 1  # vLLM's value for a process that accepts no connection (yet)


class Shared:
    """The mapping and its views. ``processes``: the API processes; slot ``processes`` is the control process's."""

    def __init__(self, processes: int, board_bytes: int = BOARD_BYTES) -> None:
        self.processes = processes
        rows = processes + 1
        self._header_bytes = _HEADER * 8
        self._slots_bytes = rows * COLUMNS * 8
        self._loads_bytes = -(-processes * 4 // 8) * 8
        self.capacity = board_bytes
        self.mem = mmap.mmap(-1, self._header_bytes + self._slots_bytes + self._loads_bytes + board_bytes)
        self.header = (ctypes.c_int64 * _HEADER).from_buffer(self.mem, 0)
        self.slots = (ctypes.c_int64 * (rows * COLUMNS)).from_buffer(self.mem, self._header_bytes)
        self.loads = (ctypes.c_int32 * processes).from_buffer(self.mem, self._header_bytes + self._slots_bytes)
        for i in range(processes):
            self.loads[i] = NOT_ACCEPTING
        self._payload_at = self._header_bytes + self._slots_bytes + self._loads_bytes
        self._lock = threading.Lock()  # the writer's threads (the engine start publishes from its own)
        self._last: bytes | None = None
        self._too_big = False

    # ------------------------------------------------------------------ the board

    def write(self, doc: dict[str, Any]) -> bool:
        """Publish ``doc`` (the control process only); False when it is what the board already holds."""
        data = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str).encode()
        with self._lock:
            if data == self._last:
                return False
            if len(data) > self.capacity:
                if not self._too_big:
                    log.error("the server-wide state (%d bytes) exceeds the board's %d bytes: the API processes keep "
                              "the last one that fitted", len(data), self.capacity)
                    self._too_big = True
                return False
            h = self.header
            h[0] += 1  # odd: being written
            self.mem[self._payload_at:self._payload_at + len(data)] = data
            h[1] = len(data)
            h[2] = zlib.crc32(data)
            h[0] += 1
            self._last = data
            return True

    @property
    def seq(self) -> int:
        return int(self.header[0])

    def read(self) -> tuple[int, dict[str, Any]]:
        """The board as last written, with its sequence number (0 and {} before the first write)."""
        h = self.header
        for attempt in range(1000):
            seq = int(h[0])
            if seq == 0:
                return 0, {}
            if seq % 2 == 0:
                n, crc = int(h[1]), int(h[2])
                data = bytes(self.mem[self._payload_at:self._payload_at + n]) if 0 <= n <= self.capacity else b""
                if int(h[0]) == seq and zlib.crc32(data) == crc:
                    return seq, json.loads(data)
            if attempt > 10:
                time.sleep(0.0001)  # a write in progress: microseconds
        raise RuntimeError("the server-wide state board could not be read (its writer is stuck mid-write)")

    # ------------------------------------------------------------------ the slots

    def set(self, slot: int, column: int, value: int) -> None:
        self.slots[slot * COLUMNS + column] = value

    def add(self, slot: int, column: int, amount: int = 1) -> None:
        self.slots[slot * COLUMNS + column] += amount

    def get(self, slot: int, column: int) -> int:
        return int(self.slots[slot * COLUMNS + column])

    def total(self, column: int) -> int:
        s = self.slots
        return sum(int(s[r * COLUMNS + column]) for r in range(self.processes + 1))

    def row(self, slot: int) -> dict[str, int]:
        names = ("inflight", "finished", "admitted", "forwarded", "seen", "pid", "up")
        return {n: self.get(slot, c) for c, n in enumerate(names)}

