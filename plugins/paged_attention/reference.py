"""Plain-PyTorch paged attention: the oracle every other implementation is tested against.

Deliberately slow and obvious: one loop over sequences, gather the sequence's context from the
block pool position by position, dense causal mask, float32 softmax. Do not optimise this file;
its only job is to be easy to believe.

int8 KV (`kv_scales` given; op.py's contract): each new token's K and V rows are quantised per
head — scale = max|x| / 127 over the head's D values, q = round(x / scale) (half to even), so every
stored value is within scale / 2 of the input — and read back as q * scale in float32.

Soft-capping (`softcap` > 0; Gemma 2's attn_logit_softcapping): every scaled score s becomes
softcap * tanh(s / softcap) before the causal mask and the softmax, as transformers' eager attention
does. 0 (the default) leaves the scores as they are.

Sliding window (`window` > 0; Mistral, windowed Qwen2/Qwen3 layers, Gemma 2/3 sliding layers): a token
at absolute position p attends to positions (p - window, p] only, i.e. max(0, p - window + 1)..p, as
transformers' sliding-window mask does (`kv_idx > q_idx - sliding_window`). Positions before the
first one any new token of a sequence can see are never read (their blocks may have been freed and
their block-table entries be placeholders). 0 (the default): every position 0..p.
"""

from __future__ import annotations

import torch

KV_QMAX = 127
"""int8 KV: symmetric, values in [-127, 127]."""


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] float -> (int8 [..., D], float32 scales [...]): one scale per row (token and head),
    scale = max|x| / 127 computed in float32; an all-zero row gets scale 0 (and zeros)."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / KV_QMAX
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(x / divisor.unsqueeze(-1)).clamp_(-KV_QMAX, KV_QMAX).to(torch.int8)
    return q, scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 [..., D] and float32 [...] -> float32 [..., D] (q * scale)."""
    return q.float() * scale.unsqueeze(-1)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scales: torch.Tensor | None = None) -> None:
    """Store the new tokens' keys/values into the pool at their flat slots (in place).

    kv_cache: [2, num_blocks, block_size, Hkv, D]; k, v: [T, Hkv, D]; slot_mapping: int64 [T].
    kv_scales (int8 KV): float32 [2, num_blocks, block_size, Hkv], kv_cache int8; k and v are
    quantised per token and head (`quantize_kv`).
    """
    num_kv_heads, head_dim = kv_cache.shape[-2], kv_cache.shape[-1]
    # [2, num_blocks * block_size, Hkv, D] view: flat slot s = block * block_size + offset.
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    slots = slot_mapping.long()
    if kv_scales is None:
        flat[0].index_copy_(0, slots, k.to(kv_cache.dtype))
        flat[1].index_copy_(0, slots, v.to(kv_cache.dtype))
        return
    flat_scales = kv_scales.view(2, -1, num_kv_heads)
    for i, x in enumerate((k, v)):
        q, scale = quantize_kv(x)
        flat[i].index_copy_(0, slots, q)
        flat_scales[i].index_copy_(0, slots, scale)


def gather_context(pool: torch.Tensor, block_table: torch.Tensor, length: int, first: int = 0) -> torch.Tensor:
    """Positions first..length-1 of one sequence, read from one pool ([num_blocks, bs, Hkv, D], or a
    scales pool [num_blocks, bs, Hkv])."""
    block_size = pool.shape[1]
    rows = []
    for pos in range(first, length):
        block = int(block_table[pos // block_size])
        rows.append(pool[block, pos % block_size])
    return torch.stack(rows)  # [length, Hkv, D]


def context_kv(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, block_table: torch.Tensor,
               length: int, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's keys and values at positions first..length-1 in float32 ([length - first, Hkv, D]
    each), dequantised when the pool is int8."""
    out = []
    for i in (0, 1):
        x = gather_context(kv_cache[i], block_table, length, first)
        if kv_scales is not None:
            x = dequantize_kv(x, gather_context(kv_scales[i], block_table, length, first))
        out.append(x.float())
    return out[0], out[1]


def paged_attention(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
                    scale: float, kv_scales: torch.Tensor | None = None, softcap: float = 0.0,
                    window: int = 0) -> torch.Tensor:
    """Write k/v into kv_cache, then causal attention of each new token over its context.

    Shapes and meaning: the op contract in op.py (and docs/architecture.md). Returns [T, Hq, D] in q's dtype.
    kv_scales: the int8 KV pool's scales (None: kv_cache holds the values themselves).
    softcap: > 0 caps the scaled scores at ±softcap (softcap * tanh(s / softcap)); 0: no capping.
    window: > 0: the token at position p sees positions (p - window, p] only; 0: all of 0..p.
    """
    write_kv(kv_cache, k, v, slot_mapping, kv_scales)
    num_heads, num_kv_heads = q.shape[1], kv_cache.shape[-2]
    group = num_heads // num_kv_heads
    out = q.new_empty(q.shape)
    for s in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        seq_len, num_new = int(seq_lens[s]), end - start
        if num_new == 0:
            continue
        # The first position any new token sees: nothing before it is read.
        first = max(0, seq_len - num_new - window + 1) if window > 0 else 0
        keys, values = context_kv(kv_cache, kv_scales, block_tables[s], seq_len, first)
        # GQA: query head h reads kv head h // group.
        keys = keys.repeat_interleave(group, dim=1)      # [L, Hq, D]
        values = values.repeat_interleave(group, dim=1)  # [L, Hq, D]
        query = q[start:end].float()                     # [n, Hq, D]
        scores = torch.einsum("nhd,lhd->hnl", query, keys) * scale  # [Hq, n, L]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        # New token j sits at absolute position seq_len - num_new + j and sees 0..that position.
        positions = seq_len - num_new + torch.arange(num_new)
        context = torch.arange(first, seq_len)[None, :]
        visible = context <= positions[:, None]  # [n, L]
        if window > 0:
            visible &= context > positions[:, None] - window
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hnl,lhd->nhd", probs, values).to(q.dtype)
    return out
