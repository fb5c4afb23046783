"""Random paged-attention batches for tests and kernel checks (CPU tests, Triton kernels, GPU).

`make_case([(cached_len, new_len), ...])` builds one packed batch the way the runtime would:
each sequence owns a shuffled, non-contiguous set of physical blocks; its cached context is
already in the pool; the whole pool (including slots no sequence owns and the slots about to be
written) is filled with random values, so an implementation that reads a slot it should not, or
reads a new slot before writing it, gets a visibly wrong answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from trtforge.plugins.paged_attention.metadata import AttentionMetadata


@dataclass
class PagedAttentionCase:
    """One random packed batch: the op's inputs plus what generated them."""

    seqs: list[tuple[int, int]]
    """(cached_len, new_len) per sequence, as requested."""
    q: torch.Tensor
    """[T, Hq, D] queries of the new tokens."""
    k: torch.Tensor
    """[T, Hkv, D] keys of the new tokens."""
    v: torch.Tensor
    """[T, Hkv, D] values of the new tokens."""
    kv_cache: torch.Tensor
    """[2, num_blocks, block_size, Hkv, D] pool, random everywhere, cached context included."""
    meta: AttentionMetadata
    """Slot mapping, block tables, lengths and offsets of the batch."""
    scale: float
    """Softmax scale (1/sqrt(D))."""
    kv_scales: torch.Tensor | None = None
    """int8 KV (`int8_kv()`): float32 [2, num_blocks, block_size, Hkv]; kv_cache is then int8."""

    def op_args(self) -> tuple:
        """Positional arguments of `torch.ops.trtforge.paged_attention` (int8 KV:
        `paged_attention_int8kv`, kv_scales last)."""
        m = self.meta
        extra = () if self.kv_scales is None else (self.kv_scales,)
        return (self.q, self.k, self.v, self.kv_cache, m.slot_mapping, m.block_tables,
                m.seq_lens, m.query_start_loc, self.scale, *extra)

    def int8_kv(self) -> "PagedAttentionCase":
        """The same case with the pool quantised to int8 KV (reference.quantize_kv per token and head)."""
        from trtforge.plugins.paged_attention.reference import quantize_kv

        q, scales = quantize_kv(self.kv_cache)
        return replace(self, kv_cache=q, kv_scales=scales)

    def clone(self) -> "PagedAttentionCase":
        """Deep copy, so two implementations can each mutate their own kv_cache."""
        m = self.meta
        meta = replace(m, slot_mapping=m.slot_mapping.clone(), block_tables=m.block_tables.clone(),
                       seq_lens=m.seq_lens.clone(), query_start_loc=m.query_start_loc.clone())
        return replace(self, q=self.q.clone(), k=self.k.clone(), v=self.v.clone(),
                       kv_cache=self.kv_cache.clone(), meta=meta,
                       kv_scales=None if self.kv_scales is None else self.kv_scales.clone())

    def to(self, device=None, dtype: torch.dtype | None = None) -> "PagedAttentionCase":
        """Same case on another device and/or with q, k, v, kv_cache in another float dtype."""
        def conv(t):
            return t.to(device=device, dtype=dtype)
        int8 = self.kv_scales is not None  # the int8 pool and its scales keep their dtypes
        return replace(self, q=conv(self.q), k=conv(self.k), v=conv(self.v),
                       kv_cache=self.kv_cache.to(device) if int8 else conv(self.kv_cache),
                       kv_scales=self.kv_scales.to(device) if int8 else None,
                       meta=self.meta.to(device) if device is not None else self.meta)


def make_case(seqs: list[tuple[int, int]], *, block_size: int = 16, num_heads: int = 4,
              num_kv_heads: int = 2, head_dim: int = 16, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu", spare_blocks: int = 3,
              extra_table_cols: int = 1, seed: int = 0) -> PagedAttentionCase:
    """Random packed batch of sequences given as (cached_len, new_len) pairs.

    spare_blocks: blocks in the pool owned by no sequence (random garbage that must never be
    read). extra_table_cols: 0-padding columns added to every block table beyond the longest
    sequence's need, as the runtime pads to max_blocks_per_seq.
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    for cached, new in seqs:
        if cached < 0 or new < 0 or cached + new == 0:
            raise ValueError(f"bad (cached_len, new_len)=({cached}, {new}): need >= 0 and a "
                             "non-empty context")
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [math.ceil((c + n) / block_size) for c, n in seqs]
    num_blocks = sum(blocks_needed) + spare_blocks
    # Shuffled physical ids: consecutive logical blocks land far apart in the pool.
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_needed) + extra_table_cols
    block_tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    slots, used = [], 0
    for s, ((cached, new), nb) in enumerate(zip(seqs, blocks_needed)):
        table = physical[used:used + nb]
        used += nb
        block_tables[s, :nb] = torch.tensor(table, dtype=torch.int32)
        for pos in range(cached, cached + new):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    num_tokens = sum(n for _, n in seqs)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    q = randn(num_tokens, num_heads, head_dim)
    k = randn(num_tokens, num_kv_heads, head_dim)
    v = randn(num_tokens, num_kv_heads, head_dim)
    kv_cache = randn(2, num_blocks, block_size, num_kv_heads, head_dim)
    new_lens = [n for _, n in seqs]
    query_start_loc = torch.tensor([0] + new_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=block_tables,
        seq_lens=torch.tensor([c + n for c, n in seqs], dtype=torch.int32),
        query_start_loc=query_start_loc,
        max_query_len=max(new_lens),
        max_seq_len=max(c + n for c, n in seqs),
    )
    case = PagedAttentionCase(seqs=list(seqs), q=q, k=k, v=v, kv_cache=kv_cache, meta=meta,
                              scale=1.0 / math.sqrt(head_dim))
    return case.to(device) if torch.device(device).type != "cpu" else case
