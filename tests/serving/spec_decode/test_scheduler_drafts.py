"""The scheduler's side of speculative decoding, torch-free: drafts take token budget and KV slots,
the committed tokens advance the sequence, rejected drafts' slots are rolled back (a block left
holding only them is freed), only committed tokens reach the prefix cache, and nothing leaks
under thousands of random verifications."""

import random

import pytest

from trtforge.config.scheduler import SchedulerConfig
from trtforge.serving.core.scheduler import Scheduler
from trtforge.serving.core.sequence import Sequence, SequenceStatus as S


def make_sched(**kw) -> Scheduler:
    base = dict(max_num_tokens=64, max_batch_size=8, prefill_chunk_size=0, prefill_max_seqs=8,
                kv_watermark=0.0, max_seq_len=64, block_size=4, num_blocks=64)
    base.update(kw)
    return Scheduler(SchedulerConfig(**base))


def prefill(sched: Scheduler, seq: Sequence, token: int = 1) -> None:
    sched.add(seq)
    out = sched.schedule()
    sched.update(out, {c.seq_id: token for c in out.chunks if c.sample})


def test_a_decode_with_drafts_is_one_chunk_of_its_token_and_the_drafts():
    sched = make_sched()
    seq = Sequence("a", list(range(10, 16)), max_tokens=20)  # 6 prompt tokens
    prefill(sched, seq, token=99)
    assert sched.decode_candidates() == ["a"]
    out = sched.schedule({"a": [5, 6, 7]})
    (chunk,) = out.chunks
    assert (chunk.start, chunk.num_tokens, chunk.num_draft_tokens, chunk.sample) == (6, 4, 3, True)
    assert chunk.token_ids == [99, 5, 6, 7]
    assert len(chunk.block_table) * 4 >= 6 + 4, "KV slots for every draft"
    assert out.num_batched_tokens == 4


def test_accepting_some_drafts_commits_them_and_rolls_back_the_rest():
    sched = make_sched()
    seq = Sequence("a", list(range(10, 17)), max_tokens=30)  # 7 prompt tokens: block 1 has 3
    prefill(sched, seq, token=99)
    free_before = sched.kv_manager.num_free_blocks
    out = sched.schedule({"a": [5, 6, 7, 8, 9]})  # positions 7..12: blocks 1, 2, 3
    assert sched.kv_manager.num_free_blocks == free_before - 2
    sched.update(out, {"a": [5, 42]})  # one draft accepted, then the target's own token
    assert seq.output_token_ids == [99, 5, 42]
    assert seq.num_computed_tokens == 9 and seq.num_uncomputed_tokens == 1
    assert len(seq.block_table) == 3, "the block holding only rejected drafts is freed"
    assert sched.kv_manager.num_free_blocks == free_before - 1
    sched.kv_manager.check_invariants()
    nxt = sched.schedule()
    assert [(c.start, c.token_ids) for c in nxt.chunks] == [(9, [42])]


def test_committed_tokens_must_be_a_prefix_of_the_drafts_plus_one():
    sched = make_sched()
    seq = Sequence("a", [1, 2, 3], max_tokens=10)
    prefill(sched, seq)
    out = sched.schedule({"a": [5, 6]})
    with pytest.raises(ValueError, match="not a prefix of its drafts"):
        sched.update(out, {"a": [6, 7]})


def test_drafts_are_capped_by_max_tokens_and_the_token_budget():
    sched = make_sched(max_num_tokens=4, prefill_chunk_size=4)
    a = Sequence("a", [1, 2, 3], max_tokens=4)
    b = Sequence("b", [4, 5, 6], max_tokens=20)
    sched.add(a)
    prefill(sched, b)  # budget 4: a's prompt, then 1 token of b's
    out = sched.schedule()  # a's decode, the rest of b's prompt
    sched.update(out, {c.seq_id: 1 for c in out.chunks if c.sample})
    assert a.num_output_tokens == 2 and b.num_output_tokens == 1
    out = sched.schedule({"a": [7, 7, 7, 7], "b": [8, 8, 8, 8]})
    by_id = {c.seq_id: c for c in out.chunks}
    # a has 2 outputs of 4: accepting d drafts + 1 token must stay within max_tokens -> d <= 1
    assert by_id["a"].num_draft_tokens == 1
    # budget 4: a takes 2, b's own decode token is reserved -> b gets 1 draft
    assert by_id["b"].num_draft_tokens == 1
    assert out.num_batched_tokens == 4


def test_drafts_never_preempt_and_are_dropped_when_blocks_run_out():
    sched = make_sched(num_blocks=2, block_size=4, max_seq_len=8)
    seq = Sequence("a", [1, 2, 3], max_tokens=5)
    prefill(sched, seq)  # 3 prompt tokens: 1 block, 1 free
    out = sched.schedule({"a": [4, 4, 4, 4]})  # positions 3..7 need 2 blocks: fits exactly
    assert out.chunks[0].num_draft_tokens == 4 - 1, "capped by max_tokens first"
    sched.update(out, {"a": [9]})
    other = Sequence("b", [7, 7, 7], max_tokens=1)
    sched.add(other)
    out = sched.schedule({"a": [4, 4, 4]})  # b takes the free block; a's drafts would need it
    assert not out.preempted
    sched.kv_manager.check_invariants()


def test_prefix_cache_keys_only_committed_tokens():
    sched = make_sched(block_size=4)
    seq = Sequence("a", [1, 2, 3, 4, 5, 6], max_tokens=20)
    prefill(sched, seq, token=7)  # computed: 6 prompt tokens; 1 full block
    assert sched.kv_manager.num_cached_blocks == 1
    out = sched.schedule({"a": [8, 9, 10, 11]})  # positions 6..10: would fill block 1 (4..7) and more
    sched.update(out, {"a": [50]})  # nothing accepted: only position 6 (token 7) is computed now
    assert seq.num_computed_tokens == 7
    assert sched.kv_manager.num_cached_blocks == 1, "block 1 is not full of committed tokens"
    # A later sequence with the same committed prefix reuses exactly the cached committed blocks.
    out = sched.schedule({"a": [51, 52]})
    sched.update(out, {"a": [51, 52, 53]})  # all accepted: positions 7, 8, 9 computed
    assert seq.all_token_ids[:10] == [1, 2, 3, 4, 5, 6, 7, 50, 51, 52]
    assert sched.kv_manager.num_cached_blocks == 2
    twin = Sequence("b", seq.all_token_ids[:9] + [0], max_tokens=1)
    hit = sched.kv_manager.find_prefix(twin)
    assert hit.num_tokens == 8 and hit.blocks == seq.block_table[:2]
    wrong = Sequence("c", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], max_tokens=1)  # the rejected drafts' tokens
    assert sched.kv_manager.find_prefix(wrong).num_tokens == 4


def test_random_verifications_keep_the_accounting_exact():
    rng = random.Random(0)
    sched = make_sched(num_blocks=40, max_num_tokens=32, max_batch_size=6, prefill_chunk_size=8,
                       enable_prefix_caching=True)
    seqs: dict[str, Sequence] = {}
    for step in range(3000):
        if len(seqs) < 10 and rng.random() < 0.3:
            sid = f"s{step}"
            base = rng.choice([0, 100, 200])  # shared prefixes
            seqs[sid] = Sequence(sid, [base + i for i in range(rng.randint(1, 20))], rng.randint(1, 30))
            sched.add(seqs[sid])
        drafts = {sid: [rng.randint(0, 5) for _ in range(rng.randint(0, 5))]
                  for sid in sched.decode_candidates() if rng.random() < 0.8}
        out = sched.schedule(drafts)
        sampled = {}
        for c in out.chunks:
            if c.sample:
                d = c.token_ids[len(c.token_ids) - c.num_draft_tokens:]
                a = rng.randint(0, len(d))
                sampled[c.seq_id] = d[:a] + [rng.randint(0, 5)]
        sched.update(out, sampled)
        for c in out.chunks:
            seq = seqs[c.seq_id]
            if seq.status is S.RUNNING and seq.num_output_tokens >= seq.max_tokens:
                sched.finish(c.seq_id, S.FINISHED_LENGTH)
                del seqs[c.seq_id]
        if seqs and rng.random() < 0.05:  # an abort, in any state
            sid = rng.choice(sorted(seqs))
            sched.finish(sid, S.FINISHED_ABORTED)
            del seqs[sid]
        sched.kv_manager.check_invariants()
        for seq in seqs.values():
            assert seq.num_output_tokens <= seq.max_tokens
    for sid in list(seqs):
        sched.finish(sid, S.FINISHED_ABORTED)
    assert sched.kv_manager.num_used_blocks == 0
