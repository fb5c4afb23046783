"""The scheduler and KV manager of a model whose every layer is windowed: a request's KV need is what one step
holds (KVCacheManager.max_held_blocks), prefix hits before the window are not revived, a handoff without the
blocks the context side freed is admitted only when this engine's window never reads them."""

from __future__ import annotations

import random

import pytest

from trtforge.config.scheduler import SchedulerConfig
from trtforge.serving.core.kv_cache_manager import FREED_BLOCK, KVCacheManager
from trtforge.serving.core.scheduler import Scheduler
from trtforge.serving.core.sequence import Sequence

W, BS = 16, 4


def config(num_blocks: int, **kw) -> SchedulerConfig:
    return SchedulerConfig(**{"max_num_tokens": 64, "max_seq_len": 512, "block_size": BS, "num_blocks": num_blocks,
                              "prefill_chunk_size": 8, "kv_watermark": 0.0, **kw})


@pytest.mark.parametrize("window", [16, 10, 3])
def test_max_held_blocks_bounds_every_step_and_is_reached(window):
    rng = random.Random(window)
    kv = KVCacheManager(num_blocks=256, block_size=BS, sliding_window=window)
    reached = False
    for trial in range(40):
        chunk = rng.randint(1, 12)
        total = rng.randint(1, 200)
        seq = Sequence(seq_id=trial, prompt_token_ids=list(range(total)), max_tokens=1)
        while seq.num_computed_tokens < total:
            n = min(rng.randint(1, chunk), total - seq.num_computed_tokens)
            assert kv.allocate_for(seq, n)
            held = kv.held_blocks(seq)
            bound = kv.max_held_blocks(total, chunk)
            assert held <= bound, f"{held} blocks held, bound {bound} (window {window}, chunk {chunk})"
            reached |= held == bound
            seq.num_computed_tokens += n
            kv.cache_full_blocks(seq)
            kv.free_out_of_window(seq)
            kv.check_invariants()
        kv.free(seq)
    assert reached, "the bound is never reached: it is looser than it needs to be"
    assert kv.num_free_blocks == kv.num_blocks


def test_admission_counts_the_window_not_the_whole_sequence():
    long = Sequence(seq_id="long", prompt_token_ids=list(range(40)), max_tokens=400)  # 110 blocks in all
    windowed = Scheduler(config(num_blocks=8), sliding_window=W)
    windowed.add(long)  # needs ceil((16 + 8 + 2) / 4) = 7 blocks at once
    assert windowed.kv_need_blocks(long) == 7
    with pytest.raises(ValueError, match="needs up to 110 KV blocks"):
        Scheduler(config(num_blocks=8)).add(Sequence(seq_id="x", prompt_token_ids=list(range(40)), max_tokens=400))
    with pytest.raises(ValueError, match="sliding window 16"):
        Scheduler(config(num_blocks=6), sliding_window=W).add(
            Sequence(seq_id="y", prompt_token_ids=list(range(40)), max_tokens=400))


def test_guaranteed_no_evict_promises_only_the_window():
    sched = Scheduler(config(num_blocks=14, policy="guaranteed_no_evict"), sliding_window=W)
    seqs = [Sequence(seq_id=i, prompt_token_ids=list(range(10 + i, 50 + i)), max_tokens=200) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    running_max = 0
    for _ in range(2000):
        out = sched.schedule()
        assert not out.preempted
        running_max = max(running_max, sched.num_running)
        sched.kv_manager.check_invariants()
        sched.update(out, {c.seq_id: 7 for c in out.chunks if c.sample})
        for seq in seqs:
            if not seq.is_finished and seq.num_output_tokens >= seq.max_tokens:
                sched.finish(seq.seq_id, seq.status.FINISHED_LENGTH)
        if all(s.is_finished for s in seqs):
            break
    assert all(s.is_finished for s in seqs) and running_max == 2  # 7 blocks each: two at once in 14
    assert sched.kv_manager.num_free_blocks == 14


def test_prefix_hit_before_the_window_is_not_revived():
    kv = KVCacheManager(num_blocks=32, block_size=BS, sliding_window=W)
    prompt = list(range(100, 141))  # 41 tokens: 10 full blocks can hit
    a = Sequence(seq_id="a", prompt_token_ids=prompt, max_tokens=1)
    assert kv.allocate_for(a, len(prompt))
    a.num_computed_tokens = len(prompt)
    kv.cache_full_blocks(a)
    kv.free(a)
    b = Sequence(seq_id="b", prompt_token_ids=list(prompt), max_tokens=1)
    hit = kv.find_prefix(b)
    dead = (40 - W + 1) // BS  # the first chunk starts at 40 and sees from 25 on
    assert len(hit.blocks) == 10 and hit.num_dead == dead == 6 and hit.num_revived == 4
    kv.admit(b, hit)
    assert b.block_table[:dead] == [FREED_BLOCK] * dead and b.block_table[dead:] == hit.blocks[dead:]
    assert all(kv.pool.ref_counts[blk] == 0 for blk in hit.blocks[:dead])
    assert kv.held_blocks(b) == 4 and kv.num_stored_tokens == 40 - dead * BS
    assert kv.allocate_for(b, 1)
    kv.check_invariants()
    b.num_computed_tokens += 1
    kv.cache_full_blocks(b)  # continues the chain after the hit, whose first blocks it does not hold
    kv.free(b)
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks


def _handoff(first_block: int, prompt_len: int = 40) -> Sequence:
    return Sequence(seq_id="h", prompt_token_ids=list(range(prompt_len)), max_tokens=20, output_token_ids=[3],
                    num_external_tokens=prompt_len, external_first_block=first_block)


def test_handoff_without_the_freed_blocks_is_admitted_behind_freed_entries():
    sched = Scheduler(config(num_blocks=8), sliding_window=W)
    seq = _handoff(first_block=6)  # 40 tokens: the token at 40 sees from 25, block 6
    sched.add(seq)
    out = sched.schedule()
    (imp,) = out.kv_imports
    assert imp.first_block == 6 and len(imp.block_table) == 10 - 6 and FREED_BLOCK not in imp.block_table
    (chunk,) = out.chunks
    assert chunk.block_table[:6] == [FREED_BLOCK] * 6 and chunk.start == 40 and chunk.is_decode
    assert sched.kv_manager.num_used_blocks == 5  # blocks 6..10: the handed-over four and the new token's
    sched.update(out, {"h": 9})
    sched.kv_manager.check_invariants()
    sched.finish("h", seq.status.FINISHED_ABORTED)
    assert sched.kv_manager.num_free_blocks == 8


@pytest.mark.parametrize("window,first_block", [(W, 7), (0, 1), (W, -1)])
def test_handoff_missing_blocks_the_window_reads_is_refused(window, first_block):
    sched = Scheduler(config(num_blocks=64), sliding_window=window)
    with pytest.raises(ValueError, match="still reads from block"):
        sched.add(_handoff(first_block))
