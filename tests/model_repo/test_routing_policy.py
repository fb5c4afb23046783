"""The router's policies (python_models/routing_policy.py): block hashes, least-loaded, prefix
affinity with its imbalance cap and bounded memory. Pure Python."""

from __future__ import annotations

import pytest

from trtforge.model_repo.python_models.routing_policy import (
    AffinityConfig,
    LeastLoaded,
    PrefixAffinity,
    block_hashes,
    make_router,
)

A, B, C = "a:1", "b:1", "c:1"


def _prompt(tag: int, n: int = 40) -> list[int]:
    return [tag * 1000 + i for i in range(n)]


def test_block_hashes_are_chained_over_whole_blocks():
    base = list(range(20))
    h = block_hashes(base, 4)
    assert len(h) == 5 and len(set(h)) == 5
    assert block_hashes(base + [99, 98], 4) == h  # a partial last block is not hashed
    changed = base[:9] + [777] + base[10:]  # a token of block 2 differs: blocks 2.. differ
    h2 = block_hashes(changed, 4)
    assert h2[:2] == h[:2] and all(x != y for x, y in zip(h2[2:], h[2:]))
    # the same tokens at block 3 after a different prefix is another prefix
    assert block_hashes([5, 5, 5, 5] + base[4:], 4)[1:] != h[1:]
    assert block_hashes(base, 4, salt="tenant") != h and block_hashes(base, 4, salt="") == h
    assert block_hashes(base[:3], 4) == []


def test_least_loaded_counts_requests_in_flight():
    router = LeastLoaded([A, B])
    assert [router.choose(), router.choose(), router.choose()] == [A, B, A]
    router.release(A)
    router.release(A)
    assert router.choose() == A and router.in_flight == {A: 1, B: 1}
    with pytest.raises(ValueError, match="at least one"):
        LeastLoaded([])


def _affinity(urls=(A, B), **kw) -> PrefixAffinity:
    return PrefixAffinity(list(urls), AffinityConfig(block_size=8, **kw))


def test_repeats_and_later_turns_go_where_the_prefix_went():
    router = _affinity()
    p, q = block_hashes(_prompt(1), 8), block_hashes(_prompt(2), 8)
    first = router.choose(p)
    router.release(first)
    for _ in range(3):
        assert router.choose(p) == first
        router.release(first)
    other = router.choose(q)  # no match anywhere, both idle: the worker chosen least recently
    assert other != first
    router.release(other)
    later_turn = block_hashes(_prompt(1) + list(range(50, 80)), 8)  # the history plus a new turn
    assert router.matched(first, later_turn) == len(p)
    assert router.choose(later_turn) == first
    router.release(first)
    assert router.choose(block_hashes(_prompt(2) + [1] * 16, 8)) == other


def test_a_hot_prefix_spills_past_the_imbalance_cap():
    router = _affinity(max_imbalance=2)
    hot = block_hashes(_prompt(7), 8)
    chosen = [router.choose(hot) for _ in range(6)]  # none released: all in flight at once
    # the worker holding the prefix takes requests while it has at most 2 more in flight; once
    # the other holds it too, the fewer in flight wins
    assert chosen == [A, A, A, B, B, B]
    assert router.in_flight == {A: 3, B: 3}
    strict = _affinity(max_imbalance=0)
    assert [strict.choose(hot) for _ in range(4)] == [A, B, A, B]  # least-loaded, in effect


def test_longest_match_wins_over_a_shorter_one():
    router = _affinity((A, B, C), max_imbalance=5)
    shared = _prompt(3, 16)
    short = block_hashes(shared, 8)
    longer = block_hashes(shared + _prompt(4, 24), 8)
    assert router.choose(short) == A
    assert router.choose(block_hashes(_prompt(5), 8)) == B  # elsewhere: nothing in common
    router.release(A), router.release(B)
    router.blocks[C].update(dict.fromkeys(longer))  # C served the longer one
    assert router.choose(longer) == C


def test_memory_is_bounded_least_recently_used_first():
    router = _affinity(max_blocks=5)
    p, q = block_hashes(_prompt(1), 8), block_hashes(_prompt(2), 8)  # 5 blocks each
    first = router.choose(p)
    router.release(first)
    assert router.matched(first, p) == 5
    router.blocks[first].update(dict.fromkeys(q))  # pretend it served q too
    router._remember(first, q)
    assert len(router.blocks[first]) == 5 and router.matched(first, p) == 0


def test_policy_and_config_are_checked_by_name():
    with pytest.raises(ValueError, match="router_policy='nearest' is invalid: choose least-loaded or prefix-affinity"):
        make_router("nearest", [A], AffinityConfig(8))
    with pytest.raises(ValueError, match="max_imbalance=-1"):
        AffinityConfig(8, max_imbalance=-1)
    with pytest.raises(ValueError, match="block_size=0"):
        AffinityConfig(0)
    assert type(make_router("least-loaded", [A], AffinityConfig(8))) is LeastLoaded
    assert type(make_router("prefix-affinity", [A], AffinityConfig(8))) is PrefixAffinity


@pytest.mark.parametrize("policy", ["least-loaded", "prefix-affinity"])
def test_a_failed_server_is_left_out_for_a_while(policy):
    router = make_router(policy, [A, B], AffinityConfig(8))
    hashes = block_hashes(_prompt(1), 8)
    home = router.choose(hashes, now=0.0)
    router.release(home)
    router.failed(home, now=1.0)
    other = B if home == A else A
    assert router.choose(hashes, now=2.0) == other  # its prefix or not, the live one
    router.release(other)
    router.failed(other, now=2.0)
    assert router.choose(hashes, now=3.0) in (A, B)  # every one down: each is tried again
    assert router.up(now=2.0 + router.retry_after_s) == [A, B]
    assert router.up(now=1.5 + router.retry_after_s) == [home]
