"""Attention metadata shared by every implementation of the paged-KV attention op.

One iteration packs T new tokens from S sequences (prefill chunks and decode tokens mixed)
into a single batch without padding. The metadata tells the op where each sequence's new
tokens sit in the packed batch and where its KV lives in the block pool:

    packed tokens:   | seq0 chunk (4 tokens) | seq1 decode (1) | seq2 chunk (3) |
    query_start_loc:   0                      4                 5              8
    seq_lens:          cached0 + 4,            cached1 + 1,      cached2 + 3
    block_tables[s]:   physical block ids of sequence s, padded with 0 past its last block
    slot_mapping[t]:   block_tables[s][p // block_size] * block_size + p % block_size,
                       p = absolute position of token t

The KV pool of one layer is `kv_cache[2, num_blocks, block_size, Hkv, D]` (index 0 = K, 1 = V).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where the packed batch's tokens come from and where their KV lives."""

    slot_mapping: torch.Tensor
    """int64 [T]: flat slot (block_id * block_size + offset) for each new token."""
    block_tables: torch.Tensor
    """int32 [S, max_blocks_per_seq]: physical block ids of each sequence (0-padded)."""
    seq_lens: torch.Tensor
    """int32 [S]: context length after this step (cached + new tokens)."""
    query_start_loc: torch.Tensor
    """int32 [S+1]: offsets of each sequence's new tokens in the packed batch."""
    max_query_len: int
    """Host copy of max(new tokens per sequence): lets kernels size their grid without a sync."""
    max_seq_len: int
    """Host copy of max(seq_lens)."""

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    def to(self, device: torch.device | str) -> "AttentionMetadata":
        return AttentionMetadata(
            slot_mapping=self.slot_mapping.to(device),
            block_tables=self.block_tables.to(device),
            seq_lens=self.seq_lens.to(device),
            query_start_loc=self.query_start_loc.to(device),
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
        )
