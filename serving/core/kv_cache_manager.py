"""Per-sequence block tables on top of the block pool, with prefix caching of full blocks.

Prefix caching (as vLLM's `docs/design/prefix_caching.md`): a FULL block whose K/V are computed is
indexed by a chained key, SHA-256(parent block's key + the block's token ids), so equal keys mean
equal prefixes up to that block. The key only finds a candidate: the pool serves a hit only when
the cached block holds the same token ids after the same preceding content (see block_pool), so a
prompt built to collide with another user's prefix is computed, never served from that user's KV.
Admission looks the prompt up block by block and reuses the hits (ref count +1). The last token of
the sequence is always recomputed — the engine needs its logits — so at most
(num_tokens - 1) // block_size blocks can hit. A block is registered only once its tokens are
computed (`cache_full_blocks`, called after each step), and a freed cached block stays in the free
queue where a later hit can revive it until it is reused.

A request's `cache_salt` (Sequence.cache_salt, vLLM's field) is folded into the root key its chain
starts from (`root_key`), so sequences with different salts compute different keys for the same
tokens and never share a block: a tenant cannot tell from time-to-first-token whether another
tenant sent a prefix. Unsalted sequences share ROOT_KEY.

KV handed over from another engine (a sequence admitted with num_external_tokens) never enters
the prefix cache, nor do the blocks after it: its tokens were not computed here, and a handoff
names its token ids itself, so caching it would serve one request's claim to another.

Sliding window (`sliding_window` > 0: every layer of the model attends within a window, the largest
of them W; ModelConfig.kv_window): `free_out_of_window`, called after each step, releases the
leading blocks no later token can see — block i once (i + 1) * block_size <= N - W + 1, N the
computed tokens (the next token, at position N, sees (N - W, N]) — and leaves `FREED_BLOCK` in their
table entries (Sequence.num_freed_blocks counts them), so a table keeps one entry per block of the
sequence (position p is still entry p // block_size) while the sequence holds at most
ceil(W / block_size) + 1 blocks in decode (`max_held_blocks` bounds a prefill chunk). The attention
op never reads an entry before its window (plugins/paged_attention/op.py); model_inputs turns the
entries into block 0 before they become a tensor, so nothing downstream sees a negative id.

    table  [ -1 | -1 | -1 | 17 |  4 | 9 ]        N = 22 computed, W = 8, block_size 4
             positions 0..11 freed   12..23: the next token (22) sees 15..22

Prefix caching stays correct: a block is registered (`cache_full_blocks`) before it is released,
and a released cached block keeps its K/V and its key in the free queue like any freed block
(no BlockRemoved event until its memory is reused, kv_events.py), so a later request with the same
prefix may revive it (its K/V depend on its tokens and the ones before them only). Such a request
revives only the hit blocks its first chunk can see: the ones before its window are admitted as
FREED_BLOCK entries (PrefixHit.num_dead) and never referenced, while its chain continues from the
last hit, so the blocks it computes are keyed by the whole prefix. A model with any full-attention
layer keeps every block (sliding_window 0).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from dataclasses import dataclass, field

from trtforge.serving.core.block_pool import BlockPool
from trtforge.serving.core.kv_events import KVEventLog
from trtforge.serving.core.sequence import SeqId, Sequence

FREED_BLOCK = -1
"""Block-table entry of a leading block released because it fell out of every layer's window."""

ROOT_KEY = hashlib.sha256(b"trtforge prefix cache v1").digest()
"""The parent key of an unsalted sequence's first block."""
_SALTED = b"trtforge prefix cache v1\0salt\0"


def root_key(cache_salt: str | None) -> bytes:
    """The parent key of a first block: ROOT_KEY without a salt, else a digest of the salt (any
    str, lone surrogates included, hashes: the salt's length is bounded at admission)."""
    if cache_salt is None:
        return ROOT_KEY
    return hashlib.sha256(_SALTED + cache_salt.encode("utf-8", "surrogatepass")).digest()


class KVCacheInvariantError(RuntimeError):
    """The block accounting is inconsistent (a bug in the runtime, never a user error)."""


def pack_tokens(tokens: list[int]) -> bytes:
    """A block's token ids as 8 bytes each: what is hashed and what a hit is checked against."""
    return array("q", tokens).tobytes()


def block_key(parent_key: bytes, packed_tokens: bytes) -> bytes:
    """Chained key of one full block. A cryptographic hash, so that a collision cannot be
    crafted (Python's hash() of a tuple of ints can); the parent key has a fixed length, so the
    concatenation is unambiguous."""
    return hashlib.sha256(parent_key + packed_tokens).digest()


@dataclass
class _Chain:
    """Where a sequence's prefix-cache chain stands after its first `num_blocks` full blocks."""

    num_blocks: int = 0
    key: bytes = ROOT_KEY
    """The key of its last full block (before the first: its root key, `root_key(salt)`)."""
    content_id: int | None = 0
    """The content id standing for its last full block's KV (0 before the first); None once a
    block could not be cached (a key collision): the blocks after it stay uncached."""


def _root_chain(seq: Sequence) -> _Chain:
    """A chain before `seq`'s first block: it starts from the root key of its salt."""
    return _Chain(key=root_key(seq.cache_salt))


@dataclass
class PrefixHit:
    """Result of a prefix-cache lookup; nothing is referenced until `KVCacheManager.admit`."""

    blocks: list[int] = field(default_factory=list)
    """Cached blocks matching the sequence's leading full blocks, in order."""
    chain: _Chain = field(default_factory=_Chain)
    """The chain after them (where `cache_full_blocks` continues)."""
    num_revived: int = 0
    """How many of the live ones (after num_dead) are currently free (taking them lowers the free count)."""
    block_size: int = 1
    num_dead: int = 0
    """Sliding window: how many leading hit blocks the first chunk (from num_tokens on) cannot see;
    admitted as FREED_BLOCK entries, never referenced."""

    @property
    def num_live(self) -> int:
        """Hit blocks the sequence will hold at admission."""
        return len(self.blocks) - self.num_dead

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.block_size


class KVCacheManager:
    """Block tables of the sequences that hold KV, with exact accounting (`check_invariants`)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int = 0) -> None:
        if block_size < 1:
            raise ValueError(f"block_size={block_size} is invalid: must be >= 1")
        if sliding_window < 0:
            raise ValueError(f"sliding_window={sliding_window} is invalid: must be >= 0 (0: keep every block)")
        self.sliding_window = sliding_window
        """> 0: every layer's window is at most this, and blocks before it are freed (module docstring)."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._holders: dict[SeqId, Sequence] = {}  # seq_id -> sequence holding blocks
        self._chains: dict[SeqId, _Chain] = {}  # seq_id -> its prefix-cache chain so far
        self.num_queried_tokens = 0
        """Tokens of admitted sequences looked up in the prefix cache."""
        self.num_hit_tokens = 0
        """Tokens of admitted sequences served from the prefix cache."""
        self.events: KVEventLog | None = None
        """What the prefix cache gains and loses (kv_events.py), once `enable_events` is called."""

    def enable_events(self, capacity: int = 1 << 16) -> KVEventLog:
        """Start logging the prefix cache's stored and removed blocks (for a KV-aware router)."""
        if self.events is None:
            self.events = KVEventLog(capacity)
            self.pool.on_evict = self.events.removed
        return self.events

    # ---- counters -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Free blocks, including cached ones that are evictable."""
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    @property
    def num_cached_blocks(self) -> int:
        return self.pool.num_cached

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by sequences."""
        return self.num_used_blocks / self.pool.num_blocks

    @property
    def num_stored_tokens(self) -> int:
        """Tokens whose K/V are in the cache, over the sequences holding blocks (for KV waste:
        1 - stored / (used blocks × block_size); shared prefix blocks count once per holder; the
        positions of blocks freed out of the sliding window are no longer stored)."""
        return sum(max(0, seq.num_computed_tokens - seq.num_freed_blocks * self.block_size)
                   for seq in self._holders.values())

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` positions."""
        return -(-num_tokens // self.block_size)

    # ---- admission ------------------------------------------------------------------------
    def find_prefix(self, seq: Sequence) -> PrefixHit:
        """Cached blocks matching the start of `seq` (which must hold no blocks). No state change."""
        hit = PrefixHit(block_size=self.block_size, chain=_root_chain(seq))
        if not self.enable_prefix_caching:
            return hit
        tokens, bs, chain = seq.all_token_ids, self.block_size, hit.chain
        for i in range((len(tokens) - 1) // bs):  # the last token is always recomputed
            packed = pack_tokens(tokens[i * bs:(i + 1) * bs])
            key = block_key(chain.key, packed)
            block = self.pool.lookup(key, chain.content_id, packed)
            if block is None:
                break
            hit.blocks.append(block)
            chain.num_blocks, chain.key, chain.content_id = i + 1, key, self.pool.content_id(block)
        hit.num_dead = self._num_dead(hit.num_tokens, len(hit.blocks))
        hit.num_revived = sum(self.pool.ref_counts[b] == 0 for b in hit.blocks[hit.num_dead:])
        return hit

    def _num_dead(self, num_computed: int, num_entries: int) -> int:
        """Leading blocks no token from position num_computed on can see (0 without a window)."""
        if self.sliding_window <= 0:
            return 0
        return min(max(0, num_computed - self.sliding_window + 1) // self.block_size, num_entries)

    def max_held_blocks(self, num_positions: int, max_chunk: int) -> int:
        """The most blocks a sequence of up to `num_positions` computed positions holds at once when no step
        computes more than `max_chunk` of its tokens. Without a window: all of them. With one (W): a step
        computing n tokens from position N holds the blocks of [N - W + 1, N + n), which span at most
        ceil((W + n + block_size - 2) / block_size) blocks (the first one partly out of the window)."""
        every = self.blocks_for(num_positions)
        if self.sliding_window <= 0:
            return every
        return min(every, self.blocks_for(self.sliding_window + max(max_chunk, 1) + self.block_size - 2))

    def held_blocks(self, seq: Sequence) -> int:
        """Blocks `seq` references (its table less the entries freed out of the window)."""
        return len(seq.block_table) - seq.num_freed_blocks

    def admit(self, seq: Sequence, hit: PrefixHit) -> None:
        """Start `seq`'s block table with the prefix hit (possibly empty); its K/V count as computed.
        The hit's dead blocks (and a handoff's blocks before its external_first_block) start as FREED_BLOCK."""
        if seq.block_table or seq.seq_id in self._holders:
            raise RuntimeError(f"sequence {seq.seq_id} is admitted but already holds KV blocks")
        dead = hit.num_dead
        if seq.num_external_tokens > 0:  # a handoff without the blocks the context side freed
            if hit.blocks:
                raise RuntimeError(f"sequence {seq.seq_id} with external KV is admitted with a prefix hit")
            dead = seq.external_first_block
        self.pool.touch(hit.blocks[dead:])
        seq.block_table = [FREED_BLOCK] * dead + hit.blocks[dead:]
        seq.num_freed_blocks = dead
        seq.num_computed_tokens = hit.num_tokens
        seq.num_cached_prefix_tokens = hit.num_tokens
        self._holders[seq.seq_id] = seq
        # content_id None: nothing of this sequence is registered (cache_full_blocks stops there).
        external = seq.num_external_tokens > 0
        self._chains[seq.seq_id] = _Chain(hit.chain.num_blocks, hit.chain.key,
                                          None if external else hit.chain.content_id)
        if self.enable_prefix_caching:
            self.num_queried_tokens += seq.num_tokens
            self.num_hit_tokens += hit.num_tokens

    # ---- growth and release ---------------------------------------------------------------
    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add so the table covers num_computed_tokens + num_new_tokens positions."""
        need = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return max(need, 0)

    def allocate_for(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow `seq`'s table for its next `num_new_tokens` tokens. All or nothing: False (and no
        change) when not enough blocks are free."""
        need = self.num_new_blocks(seq, num_new_tokens)
        if need > self.pool.num_free:
            return False
        seq.block_table.extend(self.pool.allocate(need))
        self._holders.setdefault(seq.seq_id, seq)
        if seq.seq_id not in self._chains:
            self._chains[seq.seq_id] = _root_chain(seq)
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register `seq`'s blocks that became full of computed tokens since the last call."""
        if not self.enable_prefix_caching:
            return
        chain = self._chains.get(seq.seq_id)
        if chain is None:
            chain = self._chains[seq.seq_id] = _root_chain(seq)
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= chain.num_blocks or chain.content_id is None:
            return
        tokens, bs = seq.all_token_ids, self.block_size
        for i in range(chain.num_blocks, num_full):
            block = seq.block_table[i]
            if block == FREED_BLOCK:  # free_out_of_window registers before it releases
                raise KVCacheInvariantError(f"sequence {seq.seq_id}: block {i} was freed before it was cached")
            packed = pack_tokens(tokens[i * bs:(i + 1) * bs])
            parent, chain.key = chain.key, block_key(chain.key, packed)
            indexed = self.pool.block_hash[block] is not None
            chain.content_id = self.pool.register(block, chain.key, chain.content_id, packed)
            chain.num_blocks = i + 1
            if chain.content_id is None:
                return
            if self.events is not None and not indexed and self.pool.block_hash[block] == chain.key:
                # Newly indexed (not a duplicate of a block another sequence computed at once).
                self.events.stored(chain.key, parent if i else None, tokens[i * bs:(i + 1) * bs],
                                   seq.cache_salt)

    def free_out_of_window(self, seq: Sequence) -> int:
        """Release `seq`'s leading blocks that no later token can attend to (sliding_window > 0); their
        entries become FREED_BLOCK. Registers full blocks in the prefix cache first. Returns how many."""
        dead = self._num_dead(seq.num_computed_tokens, len(seq.block_table))
        if dead <= seq.num_freed_blocks:
            return 0
        self.cache_full_blocks(seq)
        table, first = seq.block_table, seq.num_freed_blocks
        released = table[first:dead]
        table[first:dead] = [FREED_BLOCK] * (dead - first)
        seq.num_freed_blocks = dead
        self.pool.release(reversed(released))
        return len(released)

    def rollback(self, seq: Sequence) -> None:
        """Speculative decoding: shrink `seq`'s table to its computed tokens after rejected drafts
        (their slots held K/V of tokens that are not the sequence's); the blocks left holding only
        such slots are released. Those blocks were never full of computed tokens, so never cached."""
        keep = self.blocks_for(seq.num_computed_tokens)
        if len(seq.block_table) <= keep:
            return
        dropped = seq.block_table[keep:]
        if any(self.pool.block_hash[b] is not None for b in dropped):
            raise KVCacheInvariantError(f"sequence {seq.seq_id}: a rolled-back block is in the prefix cache")
        del seq.block_table[keep:]
        self.pool.release(reversed(dropped))

    def free(self, seq: Sequence) -> None:
        """Release all of `seq`'s blocks (cached ones stay revivable) and empty its table."""
        self.pool.release(reversed(seq.block_table[seq.num_freed_blocks:]))
        seq.block_table = []
        seq.num_freed_blocks = 0
        self._holders.pop(seq.seq_id, None)
        self._chains.pop(seq.seq_id, None)

    # ---- accounting -----------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise KVCacheInvariantError unless every block is free xor referenced, ref counts equal
        the number of block tables holding each block, and each table fits its sequence."""
        problems = self.pool.problems()
        held = Counter()
        for seq in self._holders.values():
            table = seq.block_table[seq.num_freed_blocks:]
            if seq.block_table[:seq.num_freed_blocks] != [FREED_BLOCK] * seq.num_freed_blocks or FREED_BLOCK in table:
                problems.append(f"sequence {seq.seq_id}: FREED_BLOCK entries are not exactly its first "
                                f"num_freed_blocks={seq.num_freed_blocks}: {seq.block_table}")
            held.update(table)
            if len(set(table)) != len(table):
                problems.append(f"sequence {seq.seq_id} holds a block twice: {table}")
            lo, hi = self.blocks_for(seq.num_computed_tokens), self.blocks_for(seq.num_tokens)
            if not lo <= len(seq.block_table) <= hi:
                problems.append(f"sequence {seq.seq_id} has {len(seq.block_table)} blocks; its "
                                f"{seq.num_computed_tokens} computed / {seq.num_tokens} tokens need "
                                f"{lo}..{hi}")
            if seq.is_finished:
                problems.append(f"finished sequence {seq.seq_id} still holds {len(table)} blocks")
        for block, ref in enumerate(self.pool.ref_counts):
            if held[block] != ref:
                problems.append(f"block {block}: ref count {ref} but held by {held[block]} tables")
        if problems:
            raise KVCacheInvariantError("KV block accounting is broken:\n  " + "\n  ".join(problems[:20]))
