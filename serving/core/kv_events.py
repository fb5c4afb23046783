"""KV cache events: what the prefix cache gains and loses, for routers outside the engine.

A KV-aware router (NVIDIA Dynamo's, and llm-d's through it) sends a prompt to the worker that
already holds most of its leading blocks. It learns what a worker holds from that worker's
events, so the events must say exactly what a later prompt could hit here:

    BlockStored    a full block of computed tokens was indexed by the prefix cache
                   (KVCacheManager.cache_full_blocks), with its token ids and its parent block
    BlockRemoved   an indexed block lost its index: its memory was reused (BlockPool.allocate)

A freed block stays indexed, and a later prefix hit revives it, until its memory is reused, so
"freed" is not "removed": the router keeps preferring a worker while the blocks are still there.
A block freed because it fell out of a sliding window (KVCacheManager.free_out_of_window) is no
different: it was stored before it was freed, and is removed once, when its memory is reused.
Blocks that never enter the prefix cache (imported from another engine, after a key collision,
or with prefix caching off) are never announced.

Keys are the prefix cache's own chained SHA-256 keys (kv_cache_manager.block_key); `block_id`
folds one to the signed 64-bit integer routers take (its first 8 bytes, little-endian). A
block's parent is the key of the block before it in its sequence (None for a first block), so
the router can rebuild the chain. A salted request's blocks (cache_salt) carry its salt: the
router only matches them for requests with the same salt.

The log is bounded: a consumer that stops draining loses the oldest events (and `dropped`
counts them), never the engine's memory. Plain data, no tensors (serving.core).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


def block_id(key: bytes) -> int:
    """A block key as a signed 64-bit integer (what Dynamo's KV events carry)."""
    return int.from_bytes(key[:8], "little", signed=True)


@dataclass(frozen=True)
class BlockStored:
    key: bytes
    parent_key: bytes | None
    """The key of the block before it in its sequence; None for a sequence's first block."""
    token_ids: tuple[int, ...]
    cache_salt: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    key: bytes


KVEvent = BlockStored | BlockRemoved


class KVEventLog:
    """Events in the order they happened, at most `capacity` of them (oldest dropped first)."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity} is invalid: must be >= 1")
        self._events: deque[KVEvent] = deque(maxlen=capacity)
        self._announced: set[bytes] = set()
        self.dropped = 0
        """Events lost because the log was full when they happened."""

    def stored(self, key: bytes, parent_key: bytes | None, token_ids: list[int], cache_salt: str | None) -> None:
        self._append(BlockStored(key, parent_key, tuple(token_ids), cache_salt))
        self._announced.add(key)

    def removed(self, key: bytes) -> None:
        if key in self._announced:  # only blocks a consumer was told about
            self._announced.discard(key)
            self._append(BlockRemoved(key))

    def drain(self) -> list[KVEvent]:
        """The events since the last drain, oldest first."""
        out = list(self._events)
        self._events.clear()
        return out

    def __len__(self) -> int:
        return len(self._events)

    def _append(self, event: KVEvent) -> None:
        if len(self._events) == self._events.maxlen:
            self.dropped += 1
        self._events.append(event)
