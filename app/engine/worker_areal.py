"""AReaL's weight sync ("xccl"), the worker's end: join the trainer's group, receive one broadcast per tensor.

AReaL's trainer builds its group with ``init_custom_process_group`` (areal/engine/core/distributed.py): a torch TCP
rendezvous at ``tcp://master:port`` (the trainer, rank 0, hosts the store), a ``PrefixStore`` keyed by the group name,
then torch's own process-group helper. The worker joins the same way, as rank ``rank_offset + worker rank``: the store
keys then match the trainer's. gloo on a CPU, NCCL on GPUs, the same code.

Each ``/areal_update_weights_xccl`` call announces its tensors first (names, dtypes, shapes, checked by the server),
then the trainer broadcasts them one by one from rank 0. A full update may come in several buckets: the worker keeps
what it received until every tensor of the model has arrived and only then reloads (vLLM's in-place reload), so a
trainer that stops midway leaves the model untouched. LoRA tensors are written as a PEFT adapter directory, which the
server validates and loads as any other adapter.
"""

from __future__ import annotations

import json
import logging
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from app.engine.rendezvous import wait_for_store
from app.engine.weight_markers import BUFFER_SUFFIXES, CLIENT_ERROR, TIMEOUT_ERROR, UNTOUCHED

log = logging.getLogger("tito.worker")

# Tensor dtypes a trainer may announce (the names AReaL sends: str(torch dtype) without "torch.").
DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8")


class _Group:
    def __init__(self, pg: Any, rank: int, world_size: int, backend: str, timeout: float) -> None:
        self.pg, self.rank, self.world_size, self.backend, self.timeout = pg, rank, world_size, backend, timeout


def custom_group(backend: str, host: str, port: int, rank: int, world_size: int, group_name: str,
                 timeout: timedelta) -> Any:
    """The group AReaL's ``init_custom_process_group`` builds on the trainer's side, built here the same way."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    store, rank, world_size = next(rendezvous(f"tcp://{host}:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store,
                                      group_name=group_name,  # type: ignore[arg-type]
                                      timeout=timeout, group_desc=group_name)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _drop_group(pg: Any) -> None:
    import torch.distributed as dist

    try:
        dist.destroy_process_group(pg)
    except Exception:  # noqa: BLE001 - a broken group cannot always be destroyed; forgetting it is enough
        from torch.distributed.distributed_c10d import _world

        _world.pg_names.pop(pg, None)


class ArealWorker:
    """Mixed into the worker extension (app/engine/worker.py)."""

    _tito_areal_groups: dict[str, _Group]
    _tito_areal_buffer: dict[str, Any]

    def _areal_groups(self) -> dict[str, _Group]:
        if not hasattr(self, "_tito_areal_groups"):
            self._tito_areal_groups = {}
            self._tito_areal_buffer = {}
        return self._tito_areal_groups

    def tito_areal_join(self, host: str, port: int, rank_offset: int, world_size: int, backend: str,
                        group_name: str, timeout: float) -> dict[str, Any]:
        pc = self.vllm_config.parallel_config  # type: ignore[attr-defined]
        per_engine = int(pc.world_size)
        rank = rank_offset + int(pc.rank) % per_engine
        if rank_offset < 1 or rank >= world_size:
            raise ValueError(f"{CLIENT_ERROR}rank {rank} (rank_offset {rank_offset} + worker {rank - rank_offset}) "
                             f"does not fit world_size {world_size} (rank 0 is the trainer).")
        groups = self._areal_groups()
        self._tito_areal_buffer.clear()  # a new group starts a new update
        old = groups.pop(group_name, None)
        if old is not None:
            _drop_group(old.pg)
        t0 = time.perf_counter()
        try:
            wait_for_store(host, port, timeout)
            pg = custom_group(backend, host, port, rank, world_size, group_name, timedelta(seconds=timeout))
        except Exception as e:  # noqa: BLE001 - a rendezvous failure is a clear timeout/connect error
            raise RuntimeError(f"{TIMEOUT_ERROR}could not join AReaL's {backend} group {group_name!r} at "
                               f"{host}:{port} as rank {rank}/{world_size} within {timeout:g}s: {e}") from None
        groups[group_name] = _Group(pg, rank, world_size, backend, timeout)
        log.info("joined AReaL's weight group %r at %s:%d as rank %d/%d (%s) in %.2fs", group_name, host, port, rank,
                 world_size, backend, time.perf_counter() - t0)
        return {"rank": rank, "world_size": world_size, "backend": backend}

    def _areal_recv(self, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]],
                    timeout: float | None) -> list[tuple[str, Any]]:
        import torch

        g = self._areal_groups().get(group_name)
        if g is None:
            raise ValueError(f"{UNTOUCHED}{CLIENT_ERROR}no weight group named {group_name!r}: call "
                             "/areal_init_weights_update_group first.")
        limit = float(timeout or g.timeout)
        out = []
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            t = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)  # type: ignore[attr-defined]
            try:
                if g.backend == "nccl":
                    torch.distributed.broadcast(t, src=0, group=g.pg)
                else:
                    opts = torch.distributed.BroadcastOptions()
                    opts.rootRank, opts.rootTensor = 0, 0
                    g.pg.broadcast([t], opts).wait(timedelta(seconds=limit))
            except Exception as e:  # noqa: BLE001 - the group is unusable after a failed collective: drop it
                self._tito_areal_groups.pop(group_name, None)
                self._tito_areal_buffer.clear()
                _drop_group(g.pg)
                raise RuntimeError(f"{UNTOUCHED}{TIMEOUT_ERROR}broadcast receive of {name!r} failed or timed out "
                                   f"after {limit:g}s ({e}); the group was dropped: call "
                                   "/areal_init_weights_update_group again.") from None
            out.append((name, t))
        return out

    def tito_areal_receive(self, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]],
                           expected: list[str], apply: bool, timeout: float | None = None) -> dict[str, Any]:
        """One bucket of a full update. With ``apply`` (the server's word that this is the last bucket) every name in
        ``expected`` must have arrived (this bucket or earlier ones) and the model is reloaded in place with all of
        them; until then nothing touches the model."""
        t0 = time.perf_counter()
        self._areal_groups()
        received = self._areal_recv(group_name, names, dtypes, shapes, timeout)
        buf = self._tito_areal_buffer
        buf.update(received)
        nbytes = sum(t.numel() * t.element_size() for _, t in received)
        if not apply:
            return {"pid": os.getpid(), "applied": False, "buffered": len(buf), "bytes": nbytes}
        missing = [n for n in expected if n not in buf]
        if missing:
            buf.clear()
            raise ValueError(f"{UNTOUCHED}{CLIENT_ERROR}the update is missing {len(missing)} tensor(s) of the model: "
                             f"{missing[:8]}.")
        items = [(n, buf[n]) for n in expected if not n.endswith(BUFFER_SUFFIXES)]
        buf.clear()
        self.tito_delta_reset()  # type: ignore[attr-defined]  # the staged-delta copy mirrors the old weights
        kept = self._tito_reload(iter(items))  # type: ignore[attr-defined]
        return {"pid": os.getpid(), "applied": True, "bytes": nbytes, "tensors": len(items),
                "seconds": time.perf_counter() - t0, **kept}

    def tito_areal_receive_lora(self, group_name: str, names: list[str], dtypes: list[str],
                                shapes: list[list[int]], directory: str, config: dict[str, Any],
                                timeout: float | None = None) -> dict[str, Any]:
        """LoRA tensors (PEFT names) received and written as a PEFT adapter directory by the engine's first worker
        (the others receive too: the broadcast needs every rank)."""
        from safetensors.torch import save_file

        received = self._areal_recv(group_name, names, dtypes, shapes, timeout)
        pc = self.vllm_config.parallel_config  # type: ignore[attr-defined]
        if int(pc.rank) % int(pc.world_size) == 0:
            # PEFT's in-memory names carry the adapter name ("lora_A.default.weight"); its files do not.
            tensors = {n.replace(".default.", "."): t.detach().contiguous().cpu() for n, t in received}
            out = Path(directory)
            out.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(out / "adapter_model.safetensors"))
            (out / "adapter_config.json").write_text(json.dumps(config))
        return {"pid": os.getpid(), "tensors": len(received)}
