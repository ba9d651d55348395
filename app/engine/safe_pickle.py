"""Restricted unpickling for the one pickle tito accepts from the network: a trainer's broadcast metadata.

Prime-RL's NCCL protocol sends ``pickle.dumps({torch.dtype: [(name, torch.Size, numel), ...]})``. A plain
``pickle.loads`` on that would run whatever callable the sender names (SGLang's LoRA-route RCE). This unpickler
resolves only torch dtypes and ``torch.Size``; everything else is refused before it is constructed.
"""

from __future__ import annotations

import functools
import io
import pickle
from typing import Any


class UnsafePickleError(ValueError):
    """The pickle named a global outside the allow-list, or is not a well-formed pickle at all."""


@functools.cache
def _allowed() -> dict[tuple[str, str], Any]:
    import torch

    allowed: dict[tuple[str, str], Any] = {("torch", "Size"): torch.Size}
    for name in dir(torch):
        obj = getattr(torch, name, None)
        if isinstance(obj, torch.dtype):
            allowed[("torch", name)] = obj
    return allowed


class _Restricted(pickle.Unpickler):
    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self._allowed = _allowed()

    def find_class(self, module: str, name: str) -> Any:
        # The single gate: the unpickler asks it for every GLOBAL/STACK_GLOBAL/INST/OBJ name and for copyreg's
        # extension codes (EXT1/2/4) too, so no opcode reaches a callable that is not listed here.
        key = (module, name)
        if key in self._allowed:
            return self._allowed[key]
        raise UnsafePickleError(f"refusing to unpickle global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError("refusing persistent ids in pickle")


def restricted_loads(data: bytes, max_bytes: int = 64 * 1024 * 1024) -> Any:
    """Unpickle ``data`` admitting only torch dtypes, ``torch.Size`` and plain containers/scalars/strings.

    Every failure is an ``UnsafePickleError`` (a ``ValueError``): a forbidden global, and equally a truncated or
    malformed stream, or allowed objects misused (``BUILD`` state on a dtype, ``torch.Size("x")``).
    """
    if len(data) > max_bytes:
        raise UnsafePickleError(f"pickle of {len(data)} bytes exceeds the limit of {max_bytes} bytes")
    try:
        return _Restricted(data).load()
    except UnsafePickleError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            OverflowError, RecursionError, MemoryError, UnicodeDecodeError) as e:
        raise UnsafePickleError(f"not a valid metadata pickle: {type(e).__name__}: {e}") from None
