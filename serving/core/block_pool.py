"""Physical KV blocks: reference counts, the LRU free queue and the prefix-cache index.

Every block is in exactly one of three states:

    in use        ref > 0, not in the free queue (it may also be cached, i.e. have a hash)
    free, cached  ref == 0, in the free queue, still indexed by its hash: a prefix hit revives it
    free          ref == 0, in the free queue, no hash

The free queue is in LRU order: the block freed longest ago is reused first, and reusing a cached
block evicts its hash. So "free" and "evictable" are the same thing, and the prefix cache costs no
memory that a running request could need.

A cached block is indexed by a key (a digest; see kv_cache_manager.block_key) and carries what it
holds: the content id of the block before it in its sequence (0 for a first block) and its packed
token ids. A lookup is a hit only when both equal the asker's, so a key collision, however it was
produced, can cost a miss but never hands one prompt's KV to another. Content ids are never
reused, so "the block before" names one computed content, not a block id that may since hold
something else.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Callable, Iterable


class BlockPool:
    """Owns the state of `num_blocks` KV blocks (ids 0..num_blocks-1); knows nothing of sequences."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} is invalid: the KV pool needs at least 1 block")
        self.num_blocks = num_blocks
        self.ref_counts: list[int] = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # What each cached block holds: (content id of the block before it, packed token ids).
        self._content: list[tuple[int, bytes] | None] = [None] * num_blocks
        self._content_id: list[int] = [0] * num_blocks  # 0: not cached
        self._next_content_id = itertools.count(1)  # 0 stands for "no block before" (a first block)
        # OrderedDict as an LRU queue with O(1) removal from the middle (prefix-hit revival).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}  # key -> block id
        self.num_evictions = 0
        """Cached blocks whose hash was dropped because the block was reused."""
        self.on_evict: Callable[[bytes], None] | None = None
        """Called with the key of each cached block evicted (kv_events: BlockRemoved)."""

    @property
    def num_free(self) -> int:
        """Free blocks, cached ones included (they are evictable)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks indexed by the prefix cache (in use or free)."""
        return len(self._cached)

    def free_blocks(self) -> list[int]:
        """The free queue, next to be reused first."""
        return list(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks from the head of the free queue (ref count 1 each)."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks but only {len(self._free)} are free")
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            h = self.block_hash[block]
            if h is not None:  # reusing a cached block evicts it from the prefix cache
                del self._cached[h]
                self.block_hash[block] = None
                self._content[block], self._content_id[block] = None, 0
                self.num_evictions += 1
                if self.on_evict is not None:
                    self.on_evict(h)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[int]) -> None:
        """Add a reference to each (cached) block; a free one is revived out of the free queue."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop a reference to each block, in the given order; unreferenced ones join the queue tail.

        Callers pass a sequence's blocks last-first, so its tail blocks (least likely to be shared
        by a later prompt) are evicted before its head blocks.
        """
        for block in blocks:
            if self.ref_counts[block] <= 0:
                raise RuntimeError(f"KV block {block} released more often than it was referenced")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None

    def lookup(self, key: bytes, parent: int, tokens: bytes) -> int | None:
        """The block cached under `key` if it holds exactly `tokens` after the block whose content
        id is `parent` (0: a sequence's first block); None otherwise."""
        block = self._cached.get(key)
        if block is None or self._content[block] != (parent, tokens):
            return None
        return block

    def content_id(self, block: int) -> int:
        """The content id of a cached block (0 if it is not cached)."""
        return self._content_id[block]

    def register(self, block: int, key: bytes, parent: int, tokens: bytes) -> int | None:
        """Index a full, computed block under `key`; returns the content id that now stands for
        its KV: a new one, or that of an identical block already cached (two requests computed
        the same prefix at once: the duplicate stays uncached). None when the key is held by
        other content (a collision) or the block is already cached: it stays uncached, and so
        must the blocks after it, whose content the index could not name."""
        held = self._cached.get(key)
        if held is not None:
            return self._content_id[held] if self._content[held] == (parent, tokens) else None
        if self.block_hash[block] is not None:
            return None
        self._cached[key] = block
        self.block_hash[block] = key
        self._content[block] = (parent, tokens)
        self._content_id[block] = next(self._next_content_id)
        return self._content_id[block]

    def problems(self) -> list[str]:
        """Inconsistencies of the pool's own state (empty when sound)."""
        out = []
        for block, ref in enumerate(self.ref_counts):
            if ref < 0:
                out.append(f"block {block} has ref count {ref} < 0")
            if (ref == 0) != (block in self._free):
                out.append(f"block {block}: ref count {ref} but in free queue = {block in self._free}")
        for h, block in self._cached.items():
            if self.block_hash[block] != h:
                out.append(f"prefix index maps a hash to block {block}, which carries another hash")
            if self._content[block] is None or not self._content_id[block]:
                out.append(f"cached block {block} carries no content")
        n_hashed = sum(h is not None for h in self.block_hash)
        if n_hashed != len(self._cached):
            out.append(f"{n_hashed} blocks carry a hash but the prefix index has {len(self._cached)}")
        return out
