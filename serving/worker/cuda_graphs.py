"""CUDA-graph replay of pure-decode steps (GPU only).

A decode step of a small model is dominated by kernel-launch overhead: hundreds of small kernels
for a handful of tokens. We capture the network once per batch size in `batch_sizes` (1, 2, 4, …)
with static input buffers, and replay the smallest graph that holds the step's batch:

    real rows  [0, B)      the step's decode tokens, block tables, lengths
    pad rows   [B, B')     token 0 at position 0, seq_len 1, written to and reading only the
                           reserved pad block (the pool's last block, never handed out)

The attention op sizes its grid from tensor shapes only (no device→host sync: plugins/paged_attention
op._triton_impl), which is what makes it capturable; the block-table width is the engine's maximum.
"""

from __future__ import annotations

from typing import Any

import torch

from trtforge.serving.worker.model_inputs import ModelInputs

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class CudaGraphRunner:
    def __init__(self, network: Any, kv_caches: list[torch.Tensor], batch_sizes: tuple[int, ...],
                 max_blocks_per_seq: int, pad_block: int, block_size: int, capture: bool = True):
        """capture=False runs the same padded static-buffer step eagerly (no graph): lets the
        padding logic be tested on CPU."""
        self.network, self.kv_caches = network, kv_caches
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.pad_block, self.block_size = pad_block, block_size
        dev = kv_caches[0].device
        n, w = self.batch_sizes[-1], max_blocks_per_seq
        i32, i64 = torch.int32, torch.int64
        self.input_ids = torch.zeros(n, dtype=i64, device=dev)
        self.positions = torch.zeros(n, dtype=i64, device=dev)
        self.slot_mapping = torch.full((n,), pad_block * block_size, dtype=i64, device=dev)
        self.block_tables = torch.full((n, w), pad_block, dtype=i32, device=dev)
        self.seq_lens = torch.ones(n, dtype=i32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=i32, device=dev)
        self.logits_indices = torch.arange(n, dtype=i64, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            self._capture_all()

    def _forward(self, b: int) -> torch.Tensor:
        from trtforge.plugins.paged_attention.metadata import AttentionMetadata

        meta = AttentionMetadata(self.slot_mapping[:b], self.block_tables[:b], self.seq_lens[:b],
                                 self.query_start_loc[:b + 1], 1, self.block_tables.shape[1] * self.block_size)
        return self.network(self.input_ids[:b], self.positions[:b], self.kv_caches, meta, self.logits_indices[:b])

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        for b in reversed(self.batch_sizes):  # largest first: smaller graphs reuse its memory pool
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up (autotuning, lazy init) outside the capture
                    self._forward(b)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(b)
            pool = graph.pool()
            self.graphs[b] = (graph, out)
        torch.cuda.synchronize()

    def can_run(self, inputs: ModelInputs) -> bool:
        """Pure decode (one token per sequence, every sequence samples) within the largest graph."""
        t = inputs.num_tokens
        return (t <= self.batch_sizes[-1] and t == inputs.meta.num_seqs == len(inputs.sample_seq_ids)
                and inputs.meta.block_tables.shape[1] <= self.block_tables.shape[1])

    @torch.inference_mode()
    def run(self, inputs: ModelInputs) -> torch.Tensor:
        b = inputs.num_tokens
        size = next(s for s in self.batch_sizes if s >= b)
        m, width = inputs.meta, inputs.meta.block_tables.shape[1]
        self.input_ids[:b].copy_(inputs.input_ids)
        self.positions[:b].copy_(inputs.positions)
        self.slot_mapping[:b].copy_(m.slot_mapping)
        self.block_tables[:b, :width].copy_(m.block_tables)
        self.seq_lens[:b].copy_(m.seq_lens)
        # pad rows [b, size) keep their capture-time values: they only touch the pad block
        if self.graphs:
            graph, out = self.graphs[size]
            graph.replay()
        else:
            out = self._forward(size)
        result = out[:b].clone()
        self.block_tables[:b].fill_(self.pad_block)  # reset rows for a later, smaller batch
        self.slot_mapping[:b].fill_(self.pad_block * self.block_size)
        self.seq_lens[:b].fill_(1)
        self.input_ids[:b].zero_()
        self.positions[:b].zero_()
        return result
