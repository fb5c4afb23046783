"""KV events (serving/core/kv_events.py): the prefix cache announces exactly the blocks a later
prompt could hit here, chained by parent, and takes them back when their memory is reused."""

from tests.serving.core.test_kv_cache_manager import BS, admit_and_compute, make_seq
from trtforge.serving.core.kv_cache_manager import ROOT_KEY, KVCacheManager, block_key, pack_tokens
from trtforge.serving.core.kv_events import BlockRemoved, BlockStored, KVEventLog, block_id


def test_stored_blocks_chain_by_parent_and_name_their_tokens():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    log = kv.enable_events()
    prompt = list(range(100, 111))  # 2 full blocks + 3 tokens
    admit_and_compute(kv, make_seq(1, prompt))
    events = log.drain()
    assert [type(e) for e in events] == [BlockStored, BlockStored]  # the partial block is not cached
    first, second = events
    assert first.parent_key is None and second.parent_key == first.key
    assert first.token_ids == tuple(prompt[:4]) and second.token_ids == tuple(prompt[4:8])
    # The keys are the prefix cache's own chained SHA-256 keys.
    assert first.key == block_key(ROOT_KEY, pack_tokens(prompt[:4]))
    assert second.key == block_key(first.key, pack_tokens(prompt[4:8]))
    assert block_id(first.key) == int.from_bytes(first.key[:8], "little", signed=True)
    assert -(1 << 63) <= block_id(second.key) < 1 << 63
    assert log.drain() == []


def test_hits_and_duplicates_are_not_announced_twice_and_growth_is():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    log = kv.enable_events()
    a = make_seq(1, range(9))
    admit_and_compute(kv, a)
    assert len(log.drain()) == 2
    b = make_seq(2, range(9))  # a prefix hit: nothing new is stored
    admit_and_compute(kv, b)
    assert log.drain() == []
    # Decoding fills the third block: it is announced once its tokens are computed.
    a.output_token_ids += [7, 7, 7]
    assert kv.allocate_for(a, 3)
    a.num_computed_tokens += 3
    kv.cache_full_blocks(a)
    (grown,) = log.drain()
    assert isinstance(grown, BlockStored) and grown.token_ids == (8, 7, 7, 7)


def test_freed_blocks_stay_announced_until_their_memory_is_reused():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    log = kv.enable_events()
    a = make_seq(1, range(9))
    admit_and_compute(kv, a)
    stored = [e.key for e in log.drain()]
    kv.free(a)
    assert log.drain() == []  # freed, still indexed: a later prompt can still hit them
    c = make_seq(3, range(50, 66))  # needs every block: the cached ones are evicted
    admit_and_compute(kv, c)
    events = log.drain()
    removed = [e.key for e in events if isinstance(e, BlockRemoved)]
    assert sorted(removed) == sorted(stored)
    assert [e.token_ids for e in events if isinstance(e, BlockStored)] == [tuple(range(50 + 4 * i, 54 + 4 * i))
                                                                       for i in range(4)]


def test_salted_blocks_carry_their_salt_and_unannounced_blocks_are_never_removed():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    seq = make_seq(1, range(9))
    seq.cache_salt = "tenant-a"
    admit_and_compute(kv, seq)  # before events were enabled: never announced
    log = kv.enable_events()
    kv.free(seq)
    salted = make_seq(2, range(20, 29))
    salted.cache_salt = "tenant-b"
    admit_and_compute(kv, salted)  # evicts the unannounced blocks: no removal for them
    events = log.drain()
    assert all(isinstance(e, BlockStored) and e.cache_salt == "tenant-b" for e in events) and len(events) == 2


def test_external_kv_and_disabled_prefix_caching_announce_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    log = kv.enable_events()
    admit_and_compute(kv, make_seq(1, range(9)))
    assert log.drain() == []
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    log = kv.enable_events()
    handed = make_seq(2, range(9))
    handed.num_external_tokens = 8
    admit_and_compute(kv, handed)
    assert log.drain() == []


def test_the_log_is_bounded():
    log = KVEventLog(capacity=3)
    for i in range(5):
        log.stored(bytes([i]) * 32, None, [i], None)
    assert len(log) == 3 and log.dropped == 2
    assert [e.token_ids for e in log.drain()] == [(2,), (3,), (4,)]
