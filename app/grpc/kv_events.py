"""``VllmEngine.SubscribeKvEvents``: vLLM's own KV-cache event publisher (``--kv-events-port``) relayed as
``smg.grpc.common.KvEventBatch`` messages, the stream the smg gateway's cache-aware policy builds its index from.

The engine core publishes msgpack ``KVEventBatch`` es on a ZMQ PUB socket as ``[topic, 8-byte big-endian sequence,
payload]`` and keeps its last batches for replay on a ROUTER socket. Each subscription here opens its own
``zmq.asyncio`` SUB socket on the tito event loop (never blocking it) and closes it when the call ends. The
publisher's sequence numbers are the batches' ``sequence_number``; a subscriber resuming from
``start_sequence_number`` N gets the buffered batches numbered N and later from the replay socket first, then the
live ones, without duplicates; a cursor the replay buffer no longer reaches is ``OUT_OF_RANGE`` (subscribe again
with 0 to start from the current state).

Decoding is plain msgspec (no vLLM import): a batch is ``[ts, events, data_parallel_rank]``, each event a map
tagged by ``type`` (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``), as vLLM's
``vllm/distributed/kv_events.py`` encodes them. Field meanings follow smg's own vLLM servicer: one ``KvBlock`` per
block hash with that block's ``block_size`` token ids (smg hashes the tokens itself), hashes reduced to signed
int64 (sha256 bytes read big-endian), the parent hash chaining a store to the blocks before it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from smg_grpc_proto.generated import common_pb2

log = logging.getLogger("tito.grpc")

_U64 = (1 << 64) - 1
_I64_SIGN = 1 << 63
END_SEQ = -1  # the replay socket's end-of-replay marker (a signed 8-byte sequence)
POLL_S = 0.5  # how often an idle subscription looks whether its call is still wanted
REPLAY_TIMEOUT_S = 10.0  # the most a replay may stay silent before the subscription gives up on it

_TIERS = {"GPU": common_pb2.KV_CACHE_TIER_DEVICE, "CPU": common_pb2.KV_CACHE_TIER_HOST,
          "STORAGE": common_pb2.KV_CACHE_TIER_DISK}
_LEVELS = {common_pb2.KV_CACHE_TIER_DEVICE: 0, common_pb2.KV_CACHE_TIER_HOST: 1, common_pb2.KV_CACHE_TIER_DISK: 2}
_LOCALITY = {"LOCAL": common_pb2.KV_CACHE_LOCALITY_LOCAL, "REMOTE": common_pb2.KV_CACHE_LOCALITY_REMOTE}


class CursorExpired(Exception):
    """The subscriber's start sequence cannot be served: the replay buffer starts later, or the publisher counts
    below it (the engine restarted)."""


def to_int64(value: int | bytes) -> int:
    """A vLLM block hash (sha256 bytes, or an int with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES) as the proto's int64:
    the low 64 bits of the big-endian number, two's complement (what smg's own servicer sends)."""
    n = int.from_bytes(value, "big") if isinstance(value, (bytes, bytearray)) else int(value)
    n &= _U64
    return n - (1 << 64) if n >= _I64_SIGN else n


def _extra_key(value: Any) -> common_pb2.KvBlockExtraKey:
    if isinstance(value, str):
        return common_pb2.KvBlockExtraKey(text=value)
    if isinstance(value, (bytes, bytearray)):
        return common_pb2.KvBlockExtraKey(blob=bytes(value))
    if isinstance(value, int):
        return common_pb2.KvBlockExtraKey(number=value)
    if isinstance(value, (list, tuple)) and len(value) == 2:  # a multimodal item: (identifier, offset)
        return common_pb2.KvBlockExtraKey(multimodal=common_pb2.KvMultimodalKey(identifier=str(value[0]),
                                                                                offset=int(value[1])))
    return common_pb2.KvBlockExtraKey(text=str(value))


def _stored(ev: dict[str, Any]) -> common_pb2.KvBlocksStored:
    size = int(ev["block_size"])
    tokens = list(ev.get("token_ids") or ())
    extra = ev.get("extra_keys") or []
    tier = _TIERS.get(ev.get("medium") or "")
    blocks = []
    for i, h in enumerate(ev["block_hashes"]):
        block = common_pb2.KvBlock(block_hash=to_int64(h), token_ids=tokens[i * size:(i + 1) * size],
                                   block_size=size)
        if ev.get("lora_id") is not None:
            block.lora_id = int(ev["lora_id"])
        if tier is not None:
            block.cache_level = _LEVELS[tier]
        if i < len(extra) and extra[i]:
            block.extra_keys.extend(_extra_key(k) for k in extra[i])
        blocks.append(block)
    out = common_pb2.KvBlocksStored(blocks=blocks)
    if ev.get("parent_block_hash") is not None:
        out.parent_block_hash = to_int64(ev["parent_block_hash"])
    if tier is not None:
        out.tier = tier
    for name in ("medium", "kv_cache_spec_kind", "ownership", "session_id", "lora_name"):
        if ev.get(name) is not None:
            setattr(out, name, str(ev[name]))
    for name in ("group_idx", "kv_cache_spec_sliding_window"):
        if ev.get(name) is not None:
            setattr(out, name, int(ev[name]))
    if ev.get("locality") in _LOCALITY:
        out.locality = _LOCALITY[ev["locality"]]
    return out


def _removed(ev: dict[str, Any]) -> common_pb2.KvBlocksRemoved:
    out = common_pb2.KvBlocksRemoved(block_hashes=[to_int64(h) for h in ev["block_hashes"]])
    tier = _TIERS.get(ev.get("medium") or "")
    if tier is not None:
        out.tier, out.cache_level = tier, _LEVELS[tier]
    for name in ("medium", "ownership"):
        if ev.get(name) is not None:
            setattr(out, name, str(ev[name]))
    if ev.get("group_idx") is not None:
        out.group_idx = int(ev["group_idx"])
    if ev.get("locality") in _LOCALITY:
        out.locality = _LOCALITY[ev["locality"]]
    return out


def convert_batch(seq: int, payload: bytes, event_id: int = 0) -> tuple[common_pb2.KvEventBatch, int]:
    """One published vLLM batch as a ``KvEventBatch`` numbered ``seq``; returns it and the last event id given
    (ids count every event of the stream, also one of an unknown type, so they stay monotonic)."""
    raw = msgspec.msgpack.decode(payload)
    if not isinstance(raw, list) or len(raw) < 2:
        raise ValueError(f"not a vLLM KVEventBatch: {str(raw)[:80]}")
    batch = common_pb2.KvEventBatch(sequence_number=seq, timestamp=float(raw[0]))
    if len(raw) > 2 and raw[2] is not None:
        batch.dp_rank = int(raw[2])
    for ev in raw[1]:
        event_id += 1
        kind = ev.get("type") if isinstance(ev, dict) else None
        if kind == "BlockStored":
            batch.events.append(common_pb2.KvCacheEvent(event_id=event_id, stored=_stored(ev)))
        elif kind == "BlockRemoved":
            batch.events.append(common_pb2.KvCacheEvent(event_id=event_id, removed=_removed(ev)))
        elif kind == "AllBlocksCleared":
            cleared = common_pb2.KvCacheCleared()
            if ev.get("ownership") is not None:
                cleared.ownership = str(ev["ownership"])
            batch.events.append(common_pb2.KvCacheEvent(event_id=event_id, cleared=cleared))
        else:
            log.debug("KV event of unknown type %r skipped", kind)
    return batch, event_id


def connectable(endpoint: str) -> str:
    """A bound wildcard (``tcp://*:5557``) is reached on loopback: the publisher runs on this host."""
    return endpoint.replace("*", "127.0.0.1").replace("0.0.0.0", "127.0.0.1")


async def _replay(ctx: zmq.asyncio.Context, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """The publisher's buffered batches numbered ``start`` and later, from its ROUTER replay socket."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(connectable(endpoint))
        await sock.send_multipart((b"", start.to_bytes(8, "big")))
        out: list[tuple[int, bytes]] = []
        while True:
            if not await sock.poll(int(REPLAY_TIMEOUT_S * 1000)):
                raise TimeoutError(f"the KV-event replay socket {endpoint} did not answer in {REPLAY_TIMEOUT_S} s")
            frames = await sock.recv_multipart()  # ["", topic, seq, payload]
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == END_SEQ:
                return out
            out.append((seq, frames[3]))
    finally:
        sock.close(linger=0)


async def stream_batches(endpoint: str, replay_endpoint: str | None, start: int,
                         wanted: Callable[[], bool]) -> AsyncIterator[common_pb2.KvEventBatch]:
    """The publisher's batches as ``KvEventBatch`` es, from ``start`` (0: from now on), while ``wanted()``."""
    ctx = zmq.asyncio.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(connectable(endpoint))  # first, so no batch falls between the replay and the live feed
        last, event_id = start - 1, 0  # the last sequence sent (start - 1: nothing yet)
        if start > 0:
            if replay_endpoint is None:
                raise CursorExpired(f"cannot resume from sequence {start}: the engine keeps no replay buffer")
            replayed = await _replay(ctx, replay_endpoint, start)
            if replayed and replayed[0][0] > start:
                raise CursorExpired(f"sequence {start} is no longer in the engine's replay buffer (it starts at "
                                    f"{replayed[0][0]})")
            for seq, payload in replayed:
                batch, event_id = convert_batch(seq, payload, event_id)
                last = seq
                yield batch
        while wanted():
            # poll, then recv: a cancelled recv future could drop a message zmq already dequeued.
            if not await sub.poll(int(POLL_S * 1000)):
                continue
            frames = await sub.recv_multipart()
            if len(frames) < 3:
                continue
            seq = int.from_bytes(frames[1], "big")
            if seq <= last:
                if start > 0 and seq < start - 1 and last == start - 1:
                    raise CursorExpired(f"the engine's publisher counts from {seq}, below the cursor {start} "
                                        "(the engine restarted)")
                continue  # already sent from the replay
            try:
                batch, event_id = convert_batch(seq, frames[2], event_id)
            except (ValueError, TypeError, KeyError, msgspec.DecodeError) as e:
                log.warning("KV event batch %d not decodable, skipped: %s", seq, e)
                continue
            last = seq
            yield batch
    finally:
        sub.close(linger=0)
