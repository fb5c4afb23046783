"""Sliding-window block freeing (KVCacheManager.free_out_of_window): a sequence decoding far past its window
holds at most ceil(window / block_size) + 1 blocks, and the attention op on its table with FREED_BLOCK entries
gives the outputs the reference gives on a pool that keeps every block."""

from __future__ import annotations

import math

import pytest
import torch

from trtforge.plugins.paged_attention import cpu, reference
from trtforge.serving.core.kv_cache_manager import FREED_BLOCK, KVCacheManager
from trtforge.serving.core.sequence import Sequence

HKV, HQ, D = 2, 4, 16


@pytest.mark.parametrize("window,block_size", [(16, 4), (10, 4), (8, 16)])
def test_decode_far_past_window_holds_constant_blocks_with_exact_outputs(window, block_size):
    bound = math.ceil(window / block_size) + 1
    prompt, steps = 23, 90
    blocks = max(bound + 1, math.ceil(prompt / block_size))  # the prompt's chunk is computed before any freeing
    kv = KVCacheManager(num_blocks=blocks, block_size=block_size, sliding_window=window)
    seq = Sequence(seq_id=1, prompt_token_ids=list(range(10, 10 + prompt)), max_tokens=steps + 1)
    total = prompt + steps
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(2, blocks, block_size, HKV, D, generator=g)
    full_pool = torch.zeros(2, math.ceil(total / block_size), block_size, HKV, D)  # never frees: the oracle's
    full_table = torch.arange(full_pool.shape[1], dtype=torch.int32)[None]
    pos = 0
    while pos < total:
        n = prompt if pos == 0 else 1
        if pos:
            seq.output_token_ids.append(7)
        assert kv.allocate_for(seq, n), "out of blocks: out-of-window blocks were not freed"
        q, k, v = (torch.randn(n, h, D, generator=g) for h in (HQ, HKV, HKV))
        table = torch.tensor([seq.block_table], dtype=torch.int32)
        slots = torch.tensor([table[0, p // block_size] * block_size + p % block_size for p in range(pos, pos + n)])
        meta = (torch.tensor([pos + n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32))
        out = cpu.paged_attention(q, k, v, pool, slots, table, *meta, D ** -0.5, window=window)
        full_slots = torch.arange(pos, pos + n)
        expected = reference.paged_attention(q, k, v, full_pool, full_slots, full_table, *meta, D ** -0.5,
                                             window=window)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        pos += n
        seq.num_computed_tokens = pos
        kv.cache_full_blocks(seq)
        kv.free_out_of_window(seq)
        kv.check_invariants()
        live = [b for b in seq.block_table if b != FREED_BLOCK]
        assert len(live) <= bound, f"{len(live)} blocks held at {pos} tokens (bound {bound})"
        assert len(seq.block_table) == kv.blocks_for(pos)  # one entry per block: position p is entry p // bs
    assert seq.block_table[0] == FREED_BLOCK
    kv.free(seq)
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_invariants()


def test_no_window_keeps_every_block():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    seq = Sequence(seq_id=1, prompt_token_ids=list(range(40)), max_tokens=1)
    assert kv.allocate_for(seq, 40)
    seq.num_computed_tokens = 40
    assert kv.free_out_of_window(seq) == 0 and FREED_BLOCK not in seq.block_table
