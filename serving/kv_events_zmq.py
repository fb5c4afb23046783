"""The prefix cache's KV events in vLLM's ZMQ wire format, for routers that read vLLM pods: llm-d's
KV-cache-aware scheduler, Ray Serve's and NVIDIA Dynamo's vLLM relay.

vLLM (`--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'`) publishes
on a ZMQ PUB socket one three-part message per engine step:

    [topic (UTF-8, default empty), sequence number (8 bytes, big-endian), payload]
    payload = msgpack of KVEventBatch, an array [ts, events, data_parallel_rank]
    event   = a map tagged by "type": BlockStored {block_hashes, parent_block_hash, token_ids,
              block_size, lora_id, medium, lora_name}, BlockRemoved {block_hashes, medium},
              AllBlocksCleared {}

This module writes exactly that from our event log (serving/core/kv_events.py): block hashes are
our chained keys folded to int64 (`block_id`), the same ids our Dynamo worker publishes, a run of
chained stored blocks is one BlockStored with its parent, evictions one BlockRemoved, medium
"GPU" (vLLM's name for the engine's own KV pool, whatever the device). A salted block
(cache_salt) is published with `extra_keys` = [salt] per block, as vLLM does.

The socket binds exactly where it is told (`tcp://*` is refused): every port is reachable by an
attacker, and the events carry the token ids of users' prompts, so bind it to loopback or a
private network the router shares. There is no authentication (vLLM's has none either). It only
sends: a PUB socket discards whatever a peer writes to it, so nothing received changes state, and
a subscriber that stops reading costs at most SEND_HIGH_WATER_MARK queued batches. msgspec
(msgpack) and pyzmq are imported here only.
"""

from __future__ import annotations

import time
from typing import Any

from trtforge.serving.core.kv_events import BlockRemoved, BlockStored, KVEvent, block_id

MEDIUM = "GPU"
SEND_HIGH_WATER_MARK = 1000
"""Batches queued per subscriber at most (one batch per engine step that changed the cache)."""


def _runs(events: list[KVEvent]) -> list[tuple[str, list[KVEvent]]]:
    """Consecutive stored blocks that chain (each the child of the one before, same salt) and
    consecutive removals, in order."""
    runs: list[tuple[str, list[KVEvent]]] = []
    for e in events:
        kind = "stored" if isinstance(e, BlockStored) else "removed"
        if runs and runs[-1][0] == kind and (
                kind == "removed" or (runs[-1][1][-1].key == e.parent_key
                                      and runs[-1][1][-1].cache_salt == e.cache_salt)):
            runs[-1][1].append(e)
        else:
            runs.append((kind, [e]))
    return runs


def batch(events: list[KVEvent], block_size: int, ts: float | None = None,
          data_parallel_rank: int | None = None) -> list[Any]:
    """The KVEventBatch of `events` as plain data (what msgpack encodes)."""
    out: list[dict[str, Any]] = []
    for kind, run in _runs(events):
        hashes = [block_id(e.key) for e in run]
        if kind == "removed":
            out.append({"type": "BlockRemoved", "block_hashes": hashes, "medium": MEDIUM})
            continue
        first: BlockStored = run[0]
        stored = {"type": "BlockStored", "block_hashes": hashes,
                  "parent_block_hash": None if first.parent_key is None else block_id(first.parent_key),
                  "token_ids": [t for e in run for t in e.token_ids], "block_size": block_size,
                  "lora_id": None, "medium": MEDIUM, "lora_name": None}
        if first.cache_salt is not None:
            stored["extra_keys"] = [[first.cache_salt] for _ in run]
        out.append(stored)
    rank = [] if data_parallel_rank is None else [data_parallel_rank]
    return [time.time() if ts is None else ts, out, *rank]


class ZmqKVEventPublisher:
    """A PUB socket that sends each drained batch of events as vLLM does."""

    def __init__(self, endpoint: str, block_size: int, topic: str = "", data_parallel_rank: int = 0) -> None:
        import msgspec
        import zmq

        if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"kv_events_endpoint={endpoint!r}: a ZMQ endpoint, e.g. tcp://127.0.0.1:5557")
        if endpoint.startswith("tcp://*"):
            raise ValueError(f"kv_events_endpoint={endpoint!r} binds every interface: name the address "
                             "(tcp://0.0.0.0:PORT if that is what you want)")
        self._encode = msgspec.msgpack.Encoder().encode
        self._socket = zmq.Context.instance().socket(zmq.PUB)
        # A subscriber that stops reading holds at most SNDHWM batches queued for it; beyond that
        # ZMQ drops its messages (PUB never blocks the engine).
        self._socket.setsockopt(zmq.SNDHWM, SEND_HIGH_WATER_MARK)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(endpoint)
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        """Where it listens (the port chosen when bound to port 0)."""
        self._topic = topic.encode()
        self._block_size, self._rank = block_size, data_parallel_rank
        self._seq = 0

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        payload = self._encode(batch(events, self._block_size, data_parallel_rank=self._rank))
        import zmq

        try:
            self._socket.send_multipart([self._topic, self._seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
        except zmq.Again:  # no room (a subscriber that stopped reading): these events are lost, not the engine
            pass
        self._seq += 1

    def close(self) -> None:
        self._socket.close(linger=0)


__all__ = ["ZmqKVEventPublisher", "batch", "BlockRemoved", "BlockStored"]
