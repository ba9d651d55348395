"""Fast tests (no engine) of the SubscribeKvEvents relay (app/grpc/kv_events.py): the conversion of vLLM's own
msgpack-encoded KV-event batches, and the live + replay feed against vLLM's real ZMQ publisher (its PUB and replay
ROUTER sockets run in a thread of this process). The engine test is in test_grpc.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import msgspec
import pytest
from smg_grpc_proto.generated import common_pb2
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

from app.grpc.kv_events import CursorExpired, convert_batch, stream_batches, to_int64
from tests.helpers import free_port

H1, H2 = bytes(range(32)), b"\xff" * 32  # sha256-sized block hashes, as vLLM publishes by default


def test_block_hashes_become_signed_int64() -> None:
    assert to_int64(H1) == int.from_bytes(H1[-8:], "big")  # the low 64 bits of the big-endian number
    assert to_int64(H2) == -1 and to_int64(7) == 7 and to_int64((1 << 64) + 5) == 5


def test_a_vllm_batch_converts_block_by_block() -> None:
    stored = BlockStored(block_hashes=[H1, H2], parent_block_hash=42, token_ids=[1, 2, 3, 4, 5, 6], block_size=3,
                         lora_id=None, medium="GPU", lora_name=None, extra_keys=[None, ("salt", ("img", 2))],
                         group_idx=0, locality="LOCAL")
    batch = KVEventBatch(ts=12.5, events=[stored, BlockRemoved(block_hashes=[H1], medium="CPU"), AllBlocksCleared()],
                         data_parallel_rank=1)
    out, last_id = convert_batch(9, msgspec.msgpack.encode(batch), event_id=3)

    assert out.sequence_number == 9 and out.timestamp == 12.5 and out.dp_rank == 1 and last_id == 6
    assert [e.event_id for e in out.events] == [4, 5, 6]
    assert [e.WhichOneof("data") for e in out.events] == ["stored", "removed", "cleared"]
    s = out.events[0].stored
    assert [list(b.token_ids) for b in s.blocks] == [[1, 2, 3], [4, 5, 6]]  # each block its own tokens
    assert [b.block_hash for b in s.blocks] == [to_int64(H1), -1] and {b.block_size for b in s.blocks} == {3}
    assert s.parent_block_hash == 42 and s.tier == common_pb2.KV_CACHE_TIER_DEVICE and s.medium == "GPU"
    assert s.locality == common_pb2.KV_CACHE_LOCALITY_LOCAL and s.HasField("group_idx") and s.group_idx == 0
    assert not s.blocks[0].extra_keys
    salt, mm = s.blocks[1].extra_keys
    assert salt.text == "salt" and (mm.multimodal.identifier, mm.multimodal.offset) == ("img", 2)
    r = out.events[1].removed
    assert list(r.block_hashes) == [to_int64(H1)] and r.tier == common_pb2.KV_CACHE_TIER_HOST and r.cache_level == 1

    first, _ = convert_batch(0, msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=[
        BlockStored(block_hashes=[5], parent_block_hash=None, token_ids=[9, 9], block_size=2, lora_id=None,
                    medium=None, lora_name=None)])))
    assert not first.HasField("dp_rank") and not first.events[0].stored.HasField("parent_block_hash")


def test_garbage_is_refused() -> None:
    with pytest.raises(ValueError):
        convert_batch(0, msgspec.msgpack.encode({"not": "a batch"}))


@pytest.fixture()
def publisher() -> Iterator[tuple[ZmqEventPublisher, str, str]]:
    port, replay = free_port(), free_port()
    pub = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay}", buffer_steps=4)
    _SENT[id(pub)] = 0
    yield pub, f"tcp://*:{port}", f"tcp://*:{replay}"
    pub.shutdown()


_SENT: dict[int, int] = {}  # publisher id -> batches published (the next batch's sequence)


def _published(pub: ZmqEventPublisher, timeout: float = 10.0) -> None:
    """Wait until the publisher's thread has sent (and buffered for replay) every batch handed to it."""
    deadline = time.monotonic() + timeout
    while pub._event_queue.unfinished_tasks:  # task_done() once a batch is sent and in the replay buffer
        assert time.monotonic() < deadline, "the publisher did not send its batches"
        time.sleep(0.005)


def _publish(pub: ZmqEventPublisher, n: int) -> None:
    """``n`` batches, each one block whose tokens are its sequence number twice."""
    for _ in range(n):
        i = _SENT.get(id(pub), 0)
        _SENT[id(pub)] = i + 1
        pub.publish(KVEventBatch(ts=time.time(), events=[
            BlockStored(block_hashes=[i], parent_block_hash=None, token_ids=[i, i], block_size=2, lora_id=None,
                        medium="GPU", lora_name=None)]))


async def _collect(endpoint: str, replay: str | None, start: int, until_seq: int, pub: ZmqEventPublisher) -> list[int]:
    """Sequence numbers the stream yields until ``until_seq``, publishing a live batch now and then (bounded)."""
    seqs: list[int] = []

    async def run() -> None:
        async for batch in stream_batches(endpoint, replay, start, lambda: True):
            seqs.append(batch.sequence_number)
            assert [list(b.token_ids) for b in batch.events[0].stored.blocks] == [[batch.sequence_number] * 2]
            if batch.sequence_number >= until_seq:
                return

    task = asyncio.ensure_future(run())
    deadline = time.monotonic() + 20
    while not task.done() and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        if seqs or start == 0:
            _publish(pub, 1)  # live batches, once the replay has answered (or at once from "now")
    if not task.done():
        task.cancel()
    await asyncio.gather(task, return_exceptions=False)
    return seqs


def test_stream_resumes_from_the_replay_buffer_then_goes_live(publisher: tuple[ZmqEventPublisher, str, str]) -> None:
    pub, endpoint, replay = publisher
    _publish(pub, 4)  # sequences 0..3, all in the buffer of 4
    _published(pub)
    seqs = asyncio.run(_collect(endpoint, replay, 2, 5, pub))
    assert seqs[:2] == [2, 3]  # replayed, from the cursor on
    assert seqs[-1] >= 5 and seqs == sorted(set(seqs))  # then live, increasing, no duplicates


def test_a_cursor_the_buffer_no_longer_holds_is_refused(publisher: tuple[ZmqEventPublisher, str, str]) -> None:
    pub, endpoint, replay = publisher
    _publish(pub, 7)  # the buffer of 4 keeps 3..6
    _published(pub)
    with pytest.raises(CursorExpired, match="starts at 3"):
        asyncio.run(_collect(endpoint, replay, 1, 99, pub))
    with pytest.raises(CursorExpired, match="no replay buffer"):
        asyncio.run(_collect(endpoint, None, 1, 99, pub))


def test_start_zero_streams_from_now(publisher: tuple[ZmqEventPublisher, str, str]) -> None:
    pub, endpoint, _ = publisher
    _publish(pub, 3)
    _published(pub)
    seqs = asyncio.run(_collect(endpoint, None, 0, 4, pub))
    assert seqs and seqs[0] >= 3 and seqs == sorted(set(seqs))  # nothing from before the subscription
