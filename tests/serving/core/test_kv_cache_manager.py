"""KV cache manager: block tables, ref counts, LRU free queue, prefix caching, invariants."""

import pytest

from trtforge.serving.core import kv_cache_manager
from trtforge.serving.core.kv_cache_manager import KVCacheInvariantError, KVCacheManager
from trtforge.serving.core.sequence import Sequence

BS = 4


def make_seq(seq_id, tokens, max_tokens=8):
    return Sequence(seq_id=seq_id, prompt_token_ids=list(tokens), max_tokens=max_tokens)


def admit_and_compute(kv, seq, n=None):
    """Admit `seq` with its prefix hit, allocate and 'compute' n tokens (default: whole prompt)."""
    hit = kv.find_prefix(seq)
    kv.admit(seq, hit)
    n = seq.num_tokens - seq.num_computed_tokens if n is None else n
    assert kv.allocate_for(seq, n)
    seq.num_computed_tokens += n
    kv.cache_full_blocks(seq)
    kv.check_invariants()
    return hit


def test_tables_grow_block_by_block_and_free_returns_everything():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    seq = make_seq(1, range(9))
    assert kv.allocate_for(seq, 5)
    assert len(seq.block_table) == 2 and kv.num_used_blocks == 2
    seq.num_computed_tokens = 5
    assert kv.allocate_for(seq, 3)  # positions 5..7 still fit block 2
    assert len(seq.block_table) == 2
    assert kv.allocate_for(seq, 4)  # positions 5..8 need a third block
    assert len(seq.block_table) == 3
    seq.num_computed_tokens = 9
    kv.check_invariants()
    kv.free(seq)
    assert seq.block_table == [] and kv.num_free_blocks == 8 and kv.usage == 0.0
    kv.check_invariants()


def test_allocate_is_all_or_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=BS, enable_prefix_caching=False)
    a, b = make_seq(1, range(8)), make_seq(2, range(8))
    assert kv.allocate_for(a, 8)
    assert not kv.allocate_for(b, 8)  # needs 2, only 1 free
    assert b.block_table == [] and kv.num_free_blocks == 1
    assert kv.allocate_for(b, 4)
    kv.check_invariants()


def test_free_queue_is_lru_and_tail_blocks_are_reused_first():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    a = make_seq(1, range(8))
    assert kv.allocate_for(a, 8)
    first, second = a.block_table
    kv.free(a)
    # a's last block was released first, so it is reused before a's first block
    queue = kv.pool.free_blocks()
    assert queue.index(second) < queue.index(first)
    assert queue[:2] == [2, 3]  # never-used blocks were freed longest ago


def test_prefix_hit_shares_full_blocks_and_recomputes_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(100, 112))  # exactly 3 full blocks
    a = make_seq(1, prompt)
    admit_and_compute(kv, a)
    assert kv.num_cached_blocks == 3
    b = make_seq(2, prompt)
    hit = admit_and_compute(kv, b, n=None)
    # the last prompt token must be recomputed: only 2 of the 3 full blocks may hit
    assert len(hit.blocks) == 2 and b.num_cached_prefix_tokens == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [kv.pool.ref_counts[x] for x in a.block_table] == [2, 2, 1]
    assert kv.num_hit_tokens == 8 and kv.num_queried_tokens == 24


def test_partial_block_is_not_cached_and_chain_depends_on_prefix():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    admit_and_compute(kv, make_seq(1, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]))  # 2 full + 2 tokens
    assert kv.num_cached_blocks == 2
    # same second block, different first block: the chained hash must not match
    other = make_seq(2, [0, 0, 0, 0, 5, 6, 7, 8, 1])
    assert kv.find_prefix(other).blocks == []
    same_first = make_seq(3, [1, 2, 3, 4, 9, 9, 9, 9, 1])
    assert len(kv.find_prefix(same_first).blocks) == 1


def test_cache_salt_keeps_prefix_hits_within_one_salt():
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    prompt = list(range(100, 113))  # 3 full blocks before the last token

    def salted(seq_id, salt):
        return Sequence(seq_id=seq_id, prompt_token_ids=list(prompt), max_tokens=8, cache_salt=salt)

    first = salted(1, "tenant-a")
    assert admit_and_compute(kv, first).blocks == []
    assert kv.num_cached_blocks == 3
    # The same tokens under another salt, or none, find nothing: not even the first block.
    assert kv.find_prefix(salted(2, "tenant-b")).blocks == []
    assert kv.find_prefix(salted(3, None)).blocks == []
    assert kv.find_prefix(salted(4, "tenant-a ")).blocks == []
    # The same salt hits every full block but the last token's.
    again = salted(5, "tenant-a")
    assert admit_and_compute(kv, again).blocks == first.block_table[:3]
    # Another salt computes and caches its own copy, which its own salt then finds.
    other = salted(6, "tenant-b")
    assert admit_and_compute(kv, other).blocks == []
    assert not set(other.block_table) & set(first.block_table)
    assert kv.num_cached_blocks == 6
    assert kv.find_prefix(salted(7, "tenant-b")).blocks == other.block_table[:3]
    tables = {seq.cache_salt: seq.block_table[:3] for seq in (first, other)}
    for seq in (first, again, other):  # freed, still revivable, still apart
        kv.free(seq)
    assert kv.find_prefix(salted(8, "tenant-b")).blocks == tables["tenant-b"]
    assert kv.find_prefix(salted(9, "tenant-a")).blocks == tables["tenant-a"]
    assert kv.find_prefix(salted(10, None)).blocks == []
    kv.check_invariants()


def test_root_keys_differ_per_salt():
    keys = {kv_cache_manager.root_key(salt) for salt in (None, "a", "b", "\ud800", "a" * 512)}
    assert len(keys) == 5 and kv_cache_manager.root_key(None) == kv_cache_manager.ROOT_KEY


def test_freed_cached_blocks_are_revived_then_evicted_when_reused():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    prompt = list(range(9))  # 2 full blocks + 1
    a = make_seq(1, prompt)
    admit_and_compute(kv, a)
    cached = a.block_table[:2]
    kv.free(a)
    assert kv.num_free_blocks == 4 and kv.num_cached_blocks == 2
    # revival: a hit on free cached blocks takes them out of the free queue
    b = make_seq(2, prompt)
    hit = kv.find_prefix(b)
    assert hit.blocks == cached and hit.num_revived == 2
    admit_and_compute(kv, b)
    assert kv.num_free_blocks == 1
    kv.free(b)
    # eviction: another prompt needs all 4 blocks, reusing (and un-indexing) the cached ones
    c = make_seq(3, range(50, 66))
    admit_and_compute(kv, c)
    assert kv.num_cached_blocks == 4 and kv.pool.num_evictions >= 2
    assert kv.find_prefix(make_seq(4, prompt)).blocks == []


def test_concurrent_duplicates_stay_uncached_and_accounting_holds():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = list(range(9))
    a, b = make_seq(1, prompt), make_seq(2, prompt)
    for s in (a, b):  # both admitted before either computed anything: no hits
        kv.admit(s, kv.find_prefix(s))
        assert kv.allocate_for(s, s.num_tokens)
    for s in (a, b):
        s.num_computed_tokens = s.num_tokens
        kv.cache_full_blocks(s)
    assert kv.num_cached_blocks == 2  # b's identical blocks are duplicates
    kv.check_invariants()
    kv.free(a)
    kv.free(b)
    kv.check_invariants()
    assert kv.num_free_blocks == 8


def test_duplicate_of_a_cached_prefix_keeps_caching_the_blocks_after_it():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a, b = make_seq(1, range(9)), make_seq(2, [*range(8), 50, 51, 52, 53, 1])
    for s in (a, b):  # both admitted before either computed anything: no hits
        kv.admit(s, kv.find_prefix(s))
        assert kv.allocate_for(s, s.num_tokens)
    for s in (a, b):
        s.num_computed_tokens = s.num_tokens
        kv.cache_full_blocks(s)
    # b's first two blocks duplicate a's (uncached); its third, new content, is cached and
    # reachable through a's identical blocks
    assert kv.num_cached_blocks == 3
    hit = kv.find_prefix(make_seq(3, [*range(8), 50, 51, 52, 53, 7]))
    assert hit.blocks == a.block_table[:2] + [b.block_table[2]]


@pytest.fixture
def constant_key(monkeypatch):
    """Every block gets the same key: the strongest collision an attacker could hope for."""
    monkeypatch.setattr(kv_cache_manager, "block_key", lambda parent, packed: b"\0" * 32)


def test_key_collision_is_a_miss_not_another_prompts_kv(constant_key):
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    victim = make_seq(1, range(100, 109))
    admit_and_compute(kv, victim)
    assert kv.num_cached_blocks == 1  # one key: the second block collided and stayed uncached
    attacker = make_seq(2, range(200, 209))
    assert kv.find_prefix(attacker).blocks == []
    hit = admit_and_compute(kv, attacker)
    assert hit.blocks == [] and kv.num_hit_tokens == 0
    assert set(attacker.block_table).isdisjoint(victim.block_table)
    # the genuine owner of the key still hits it, and only it
    assert kv.find_prefix(make_seq(3, range(100, 109))).blocks == victim.block_table[:1]


def test_same_tokens_after_another_prefix_are_a_miss(monkeypatch):
    # A key that ignores the parent: a block's tokens alone decide it. The parent check must
    # still refuse a cached block whose tokens sit after a different prefix (or position).
    monkeypatch.setattr(kv_cache_manager, "block_key", lambda parent, packed: packed)
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_seq(1, [7, 7, 7, 7, 7, 7, 7, 7, 1])  # two equal blocks: the second collides
    admit_and_compute(kv, a)
    again = kv.find_prefix(make_seq(2, [7, 7, 7, 7, 7, 7, 7, 7, 1]))
    assert again.blocks == a.block_table[:1], "a block must never be reused at another position"
    other = make_seq(3, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit_and_compute(kv, other)
    moved = make_seq(4, [9, 9, 9, 9, 5, 6, 7, 8, 1])  # other's second block after other tokens
    admit_and_compute(kv, moved)
    hit = kv.find_prefix(make_seq(5, [9, 9, 9, 9, 5, 6, 7, 8, 2]))
    assert hit.blocks == moved.block_table[:1], "other's 2nd block was computed after 1, 2, 3, 4"


def test_hashing_is_a_cryptographic_digest_of_parent_and_tokens():
    root = kv_cache_manager.ROOT_KEY
    key = kv_cache_manager.block_key(root, kv_cache_manager.pack_tokens([1, 2, 3, 4]))
    assert len(key) == 32
    assert key != kv_cache_manager.block_key(root, kv_cache_manager.pack_tokens([1, 2, 3, 5]))
    assert key != kv_cache_manager.block_key(key, kv_cache_manager.pack_tokens([1, 2, 3, 4]))
    # token ids beyond 32 bits are packed whole, not truncated
    assert kv_cache_manager.pack_tokens([2**40]) != kv_cache_manager.pack_tokens([0])


def test_prefix_caching_disabled_never_hits():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    admit_and_compute(kv, make_seq(1, range(9)))
    assert kv.num_cached_blocks == 0
    assert kv.find_prefix(make_seq(2, range(9))).blocks == []


def test_check_invariants_catches_corruption():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    a = make_seq(1, range(6))
    assert kv.allocate_for(a, 6)
    kv.check_invariants()
    kv.pool.ref_counts[a.block_table[0]] += 1  # a leaked reference
    with pytest.raises(KVCacheInvariantError, match="ref count 2 but held by 1"):
        kv.check_invariants()
    kv.pool.ref_counts[a.block_table[0]] -= 1
    a.block_table.append(a.block_table[0])  # a block twice in a table
    with pytest.raises(KVCacheInvariantError, match="holds a block twice"):
        kv.check_invariants()


def test_release_more_than_referenced_is_refused():
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    with pytest.raises(RuntimeError, match="released more often"):
        kv.pool.release([0])
