"""Plain-PyTorch paged attention: the oracle every other implementation is tested against.

Deliberately slow and obvious: one loop over sequences, gather the sequence's context from the
block pool position by position, dense causal mask, float32 softmax. Do not optimise this file;
its only job is to be easy to believe.
"""

from __future__ import annotations

import torch


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' keys/values into the pool at their flat slots (in place).

    kv_cache: [2, num_blocks, block_size, Hkv, D]; k, v: [T, Hkv, D]; slot_mapping: int64 [T].
    """
    num_kv_heads, head_dim = kv_cache.shape[-2], kv_cache.shape[-1]
    # [2, num_blocks * block_size, Hkv, D] view: flat slot s = block * block_size + offset.
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    slots = slot_mapping.long()
    flat[0].index_copy_(0, slots, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, v.to(kv_cache.dtype))


def gather_context(pool: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Positions 0..length-1 of one sequence, read from one pool ([num_blocks, bs, Hkv, D])."""
    block_size = pool.shape[1]
    rows = []
    for pos in range(length):
        block = int(block_table[pos // block_size])
        rows.append(pool[block, pos % block_size])
    return torch.stack(rows)  # [length, Hkv, D]


def paged_attention(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
                    scale: float) -> torch.Tensor:
    """Write k/v into kv_cache, then causal attention of each new token over its context.

    Shapes and meaning: the op contract in op.py (and docs/architecture.md). Returns [T, Hq, D] in q's dtype.
    """
    write_kv(kv_cache, k, v, slot_mapping)
    num_heads, num_kv_heads = q.shape[1], kv_cache.shape[-2]
    group = num_heads // num_kv_heads
    out = q.new_empty(q.shape)
    for s in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        seq_len, num_new = int(seq_lens[s]), end - start
        if num_new == 0:
            continue
        keys = gather_context(kv_cache[0], block_tables[s], seq_len).float()
        values = gather_context(kv_cache[1], block_tables[s], seq_len).float()
        # GQA: query head h reads kv head h // group.
        keys = keys.repeat_interleave(group, dim=1)      # [L, Hq, D]
        values = values.repeat_interleave(group, dim=1)  # [L, Hq, D]
        query = q[start:end].float()                     # [n, Hq, D]
        scores = torch.einsum("nhd,lhd->hnl", query, keys) * scale  # [Hq, n, L]
        # New token j sits at absolute position seq_len - num_new + j and sees 0..that position.
        positions = seq_len - num_new + torch.arange(num_new)
        visible = torch.arange(seq_len)[None, :] <= positions[:, None]  # [n, L]
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hnl,lhd->nhd", probs, values).to(q.dtype)
    return out
