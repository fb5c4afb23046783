"""Tensor parallelism's wire: the process group, the per-step message, the network's collectives.

Rank 0 runs the scheduler; every step it broadcasts the step's plain data (token ids, positions,
slots, block tables, sequence lengths, the rows to sample) as int64 tensors, two broadcasts:

    header  int64 [8]: kind, body length, T, S, block-table width, S', max_query_len, max_seq_len
    body    int64 [body length]: input_ids[T] positions[T] slot_mapping[T] block_tables[S·W]
                                  seq_lens[S] query_start_loc[S+1] logits_indices[S']

kind STEP runs the network; INIT (once, after joining) carries the KV block count and the engine's
identity; PING keeps an idle group's waiting ranks inside their timeout; STOP ends them. Tensors,
not pickles: the same code runs over gloo (CPU) and NCCL (CUDA), and nothing but numbers is sent.
"""

from __future__ import annotations

import hashlib
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trtforge.models.engine_dir import EngineConfig
from trtforge.models.tensor_parallel import TPShard
from trtforge.plugins.paged_attention.metadata import AttentionMetadata
from trtforge.serving.worker.model_inputs import ModelInputs

STEP, PING, STOP, INIT = 1, 2, 3, 4
HEADER = 8
TIMEOUT_ENV = "TRTFORGE_TP_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0


def timeout_s() -> float:
    """How long a rank waits for the others in any collective (and to join): a dead peer's error."""
    return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def join_group(store: dist.Store, rank: int, world: int, device: torch.device) -> None:
    """Join the default process group through `store` (rank 0's TCPStore at MASTER_ADDR:MASTER_PORT)."""
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group: one tensor-parallel "
                           "engine per process (close the other one first).")
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s()))


def engine_identity(cfg: EngineConfig) -> int:
    """A 62-bit digest of the engine's file checksums: every rank must load the same engine."""
    text = "".join(f"{k}={v};" for k, v in sorted(cfg.files.items()))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2


def send(kind: int, device: torch.device, body: torch.Tensor | None = None, fields: tuple[int, ...] = ()) -> None:
    """Rank 0: broadcast one message."""
    header = torch.zeros(HEADER, dtype=torch.int64)
    n = 0 if body is None else body.numel()
    header[:2 + len(fields)] = torch.tensor([kind, n, *fields], dtype=torch.int64)
    dist.broadcast(header.to(device), src=0)
    if n:
        dist.broadcast(body, src=0)


def receive(device: torch.device) -> tuple[int, list[int], torch.Tensor | None]:
    """Ranks > 0: (kind, the header's fields after the length, body or None)."""
    header = torch.empty(HEADER, dtype=torch.int64, device=device)
    dist.broadcast(header, src=0)
    kind, n, *fields = header.tolist()
    body = None
    if n:
        body = torch.empty(n, dtype=torch.int64, device=device)
        dist.broadcast(body, src=0)
    return kind, fields, body


def encode_step(inputs: ModelInputs) -> tuple[torch.Tensor, tuple[int, ...]]:
    """A step's ModelInputs as (body, header fields)."""
    m = inputs.meta
    parts = [inputs.input_ids, inputs.positions, m.slot_mapping, m.block_tables.reshape(-1), m.seq_lens,
             m.query_start_loc, inputs.logits_indices]
    body = torch.cat([p.to(torch.int64) for p in parts])
    s, width = m.block_tables.shape
    return body, (inputs.num_tokens, s, width, int(inputs.logits_indices.numel()), int(m.max_query_len),
                  int(m.max_seq_len))


def decode_step(body: torch.Tensor, fields: list[int]) -> ModelInputs:
    """The ModelInputs rank 0 encoded (no seq ids: ranks > 0 do not sample)."""
    t, s, width, rows, max_q, max_s = fields
    sizes = [t, t, t, s * width, s, s + 1, rows]
    ids, pos, slots, tables, seq_lens, starts, logits_indices = body.split(sizes)
    i32 = torch.int32
    meta = AttentionMetadata(slot_mapping=slots, block_tables=tables.view(s, width).to(i32),
                             seq_lens=seq_lens.to(i32), query_start_loc=starts.to(i32),
                             max_query_len=max_q, max_seq_len=max_s)
    return ModelInputs(input_ids=ids, positions=pos, meta=meta, logits_indices=logits_indices, sample_seq_ids=[])


class Collectives:
    """What a rank's network calls between its shards: the all-reduce after o_proj and down, the
    logits' all-gather. Counts calls, bytes and seconds (scripts/bench_tp.py reads them)."""

    def __init__(self, shard: TPShard, vocab_size: int):
        self.shard, self.vocab_size = shard, vocab_size
        self.reduce_calls = self.reduce_bytes = 0
        self.reduce_seconds = 0.0
        self.gather_calls = self.gather_bytes = 0
        self.gather_seconds = 0.0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        dist.all_reduce(t)
        self.reduce_seconds += time.perf_counter() - start
        self.reduce_calls += 1
        self.reduce_bytes += t.numel() * t.element_size()
        return t

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        pad = self.shard.vocab_per_rank - logits.shape[1]  # the last slice may be shorter
        part = (F.pad(logits, (0, pad)) if pad else logits).contiguous()
        parts = [torch.empty_like(part) for _ in range(self.shard.size)]
        dist.all_gather(parts, part)
        out = torch.cat(parts, dim=1)[:, :self.vocab_size]
        self.gather_seconds += time.perf_counter() - start
        self.gather_calls += 1
        self.gather_bytes += part.numel() * part.element_size() * self.shard.size
        return out

    def reset(self) -> None:
        self.__init__(self.shard, self.vocab_size)
