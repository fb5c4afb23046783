"""The prefix cache's KV events in vLLM's ZMQ format (serving/kv_events_zmq.py), read by a ZMQ
subscriber as llm-d's scheduler reads a vLLM pod: three-part messages [topic, seq, msgpack], the
payload decoded against vLLM's event classes (transcribed below field for field from
vllm/distributed/kv_events.py: KVEventBatch, BlockStored, BlockRemoved; msgspec rejects any
payload that does not fit them), from a real engine's events."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from tests.serving.test_disaggregated_engine import engine_dir  # noqa: F401 - fixture
from trtforge.config.sampling import SamplingParams
from trtforge.serving.core.kv_events import block_id
from trtforge.serving.engine import LLMEngine
from trtforge.serving.kv_events_zmq import ZmqKVEventPublisher

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class _Event(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None = None


class BlockRemoved(_Event):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(_Event):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def _receive(sub: zmq.Socket) -> list[tuple[int, KVEventBatch]]:
    out = []
    while sub.poll(500):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b""
        out.append((int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload, type=KVEventBatch)))
    return out


def test_an_engines_events_reach_a_subscriber_in_vllms_format(engine_dir):  # noqa: F811
    engine = LLMEngine.from_engine_dir(engine_dir)
    log = engine.scheduler.kv_manager.enable_events()
    bs = engine.scheduler_config.block_size
    publisher = ZmqKVEventPublisher("tcp://127.0.0.1:0", bs)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(publisher.endpoint)
    try:
        assert publisher.endpoint.startswith("tcp://127.0.0.1:")  # loopback, as asked
        publisher.publish([])  # nothing drained: nothing sent
        import time

        time.sleep(0.3)  # a SUB socket sees only what is sent after it joined
        prompt = engine.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 4)
        engine.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))
        drained = log.drain()
        publisher.publish(drained)
        (seq, batch), = _receive(sub)
        assert seq == 0 and batch.data_parallel_rank == 0
        stored = [e for e in batch.events if isinstance(e, BlockStored)]
        full = len(prompt) // bs
        assert stored and stored[0].parent_block_hash is None and stored[0].block_size == bs
        assert [t for e in stored for t in e.token_ids][:full * bs] == prompt[:full * bs]
        # The hashes are our prefix cache's keys folded to int64, chained through parent_block_hash.
        assert [h for e in stored for h in e.block_hashes] == [block_id(e.key) for e in drained]
        for before, after in zip(stored, stored[1:]):
            assert after.parent_block_hash == before.block_hashes[-1]
        # Overfill the pool: every announced block that is reused is removed, by the same hash.
        announced = {h for e in stored for h in e.block_hashes}
        total = engine.scheduler_config.num_blocks * bs
        length = min(1000, engine.scheduler_config.max_seq_len - 8)
        others = [[(13 * i + 5 * j) % 400 + 3 for j in range(length)] for i in range(total // length + 3)]
        engine.generate(others, SamplingParams(max_tokens=1))
        publisher.publish(log.drain())
        batches = _receive(sub)
        assert [s for s, _ in batches] == [1]
        removed = {h for e in batches[0][1].events if isinstance(e, BlockRemoved) for h in e.block_hashes}
        assert announced <= removed, "every block of the first prompt was evicted and announced removed"
    finally:
        sub.close(linger=0)
        publisher.close()


@pytest.mark.parametrize(("endpoint", "message"), [("tcp://*:5557", "binds every interface"),
                                                   ("http://127.0.0.1:5557", "a ZMQ endpoint")])
def test_a_publisher_refuses_endpoints_it_should_not_bind(endpoint, message):
    with pytest.raises(ValueError, match=message):
        ZmqKVEventPublisher(endpoint, 8)


def test_a_hostile_peer_on_the_port_changes_nothing_and_subscribers_still_get_events(engine_dir):  # noqa: F811
    """Raw TCP garbage, a half-open ZMTP greeting and a subscriber that never reads: the publisher
    keeps sending, and a good subscriber still decodes every batch."""
    import socket
    import time

    engine = LLMEngine.from_engine_dir(engine_dir)
    log = engine.scheduler.kv_manager.enable_events()
    publisher = ZmqKVEventPublisher("tcp://127.0.0.1:0", engine.scheduler_config.block_size)
    host, port = publisher.endpoint.removeprefix("tcp://").rsplit(":", 1)
    raw = [socket.create_connection((host, int(port))) for _ in range(3)]
    raw[0].sendall(b"\x00" * 70000)  # garbage
    raw[1].sendall(b"\xff" + b"\x00" * 8 + b"\x7f\x03")  # a ZMTP greeting cut short
    lazy = zmq.Context.instance().socket(zmq.SUB)  # subscribes, never reads
    lazy.setsockopt(zmq.SUBSCRIBE, b"")
    lazy.connect(publisher.endpoint)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(publisher.endpoint)
    try:
        time.sleep(0.3)
        for i in range(5):
            engine.generate([engine.tokenizer.encode(f"request {i} " * 8)], SamplingParams(max_tokens=1))
            publisher.publish(log.drain())
        batches = _receive(sub)
        assert [s for s, _ in batches] == list(range(5))
        assert all(any(isinstance(e, BlockStored) for e in b.events) for _, b in batches)
    finally:
        for s in raw:
            s.close()
        lazy.close(linger=0)
        sub.close(linger=0)
        publisher.close()
