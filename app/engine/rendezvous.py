"""Waiting for a trainer's TCP store before joining its group (Prime-RL's broadcast, AReaL's weight group)."""

from __future__ import annotations

import socket
import time


def wait_for_store(host: str, port: int, timeout: float) -> None:
    """Wait, within ``timeout``, until the trainer's TCPStore accepts connections. torch's store client retries a
    refused connect on its own clock (minutes), and on a local port nobody listens on, one of its retries can
    connect the socket to itself (TCP self-connect: the ephemeral source port equals the target) and then wait for
    an answer that never comes, holding the worker, and so the engine loop, long past the caller's timeout."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, left))) as s:
                if s.getsockname() != s.getpeername():
                    return
        except OSError:
            pass
        if left <= 0:
            raise TimeoutError(f"nothing accepted a connection on {host}:{port}")
        time.sleep(min(0.2, max(0.0, left)))
