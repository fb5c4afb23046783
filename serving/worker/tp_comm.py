"""Tensor parallelism's wire: the process group, its timed collectives, sending and receiving the
step message (tp_message.py), the network's collectives.

Rank 0 runs the scheduler; every step it broadcasts the step's plain data as int64 tensors (a
header, then a body), checked on arrival against the rank's own limits before anything is
allocated. Tensors, not pickles: the same code runs over gloo (CPU) and NCCL (CUDA), and nothing
but numbers is sent.

Two timeouts (seconds, from the environment):

    TRTFORGE_TP_TIMEOUT_S       300  meeting: the rendezvous, the key's proof, INIT, loading the
                                     shards (the first collective after it waits for the slowest)
    TRTFORGE_TP_PEER_TIMEOUT_S   10  running: every later collective (steps, the network's
                                     all-reduces and all-gathers, pings); a peer silent that long
                                     is an error naming the timeout, not a hang

A rank that dies closes its connections, which its peers see at once; the peer timeout bounds
the wait on one that stops answering without closing them (a lost host, a stopped process).
While idle, rank 0 sends a PING every second (`ping_interval_s`), which every rank answers with a
one-value all-reduce: the waiting ranks stay inside their timeout, and rank 0 learns within a
second that a rank has gone.
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
from trtforge.models.kv_sizing import kv_bytes_per_token
from trtforge.models.tensor_parallel import TPShard, local_config, shard_of
from trtforge.serving.worker.tp_message import HEADER, INIT, PING, STEP, STOP, MessageLimits

__all__ = ["HEADER", "INIT", "PING", "STEP", "STOP", "Collectives", "MessageLimits", "receive", "send"]

TIMEOUT_ENV = "TRTFORGE_TP_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0
PEER_TIMEOUT_ENV = "TRTFORGE_TP_PEER_TIMEOUT_S"
DEFAULT_PEER_TIMEOUT_S = 10.0
BROKEN_KEY = "trtforge/broken"
"""Store key: why rank 0 ended the group (what the other ranks say as they stop)."""


def timeout_s() -> float:
    """How long ranks wait for each other while meeting (joining, proving the key, loading)."""
    return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))


def peer_timeout_s() -> float:
    """How long a running rank waits on a silent peer in any collective."""
    return float(os.environ.get(PEER_TIMEOUT_ENV, DEFAULT_PEER_TIMEOUT_S))


def ping_interval_s() -> float:
    return min(1.0, peer_timeout_s() / 5)


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


def max_kv_blocks(cfg: EngineConfig, rank: int, device: torch.device) -> int:
    """The most KV blocks of `cfg` this rank's pool could hold in its device's whole memory: the
    bound on what an INIT may ask it to allocate."""
    local = local_config(cfg.model, shard_of(cfg.model, cfg.tp_size, rank))
    per_block = kv_bytes_per_token(local, cfg.dtype, cfg.build.get("kv_cache_dtype")) * cfg.block_size
    if device.type == "cuda":
        memory = torch.cuda.mem_get_info(device)[1]
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, memory // per_block)


# ---- collectives with a timeout (the default group; no reference to it is kept, so that
# destroying it closes its connections at once) -----------------------------------------------
def _timed(options, timeout: float):
    opts = options()
    opts.timeout = timedelta(seconds=timeout)
    opts.asyncOp = False
    return opts


def broadcast(t: torch.Tensor, timeout: float) -> None:
    opts = _timed(dist.BroadcastOptions, timeout)
    opts.rootRank, opts.rootTensor = 0, 0
    dist.group.WORLD.broadcast([t], opts).wait()


def all_reduce(t: torch.Tensor, timeout: float) -> torch.Tensor:
    dist.group.WORLD.allreduce([t], _timed(dist.AllreduceOptions, timeout)).wait()
    return t


def all_gather(parts: list[torch.Tensor], t: torch.Tensor, timeout: float) -> None:
    dist.group.WORLD.allgather([parts], [t], _timed(dist.distributed_c10d.AllgatherOptions, timeout)).wait()


def gather_rows(t: torch.Tensor, timeout: float | None = None) -> torch.Tensor:
    """[world, n]: every rank's `t` (n values), for the key's proof."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    all_gather(parts, t.contiguous(), timeout_s() if timeout is None else timeout)
    return torch.stack(parts)


def _ack(device: torch.device, timeout: float) -> None:
    all_reduce(torch.ones(1, dtype=torch.int64, device=device), timeout)


# ---- the message ---------------------------------------------------------------------------
def send(kind: int, device: torch.device, body: torch.Tensor | None = None, fields: tuple[int, ...] = (),
         timeout: float | None = None) -> None:
    """Rank 0: broadcast one message (a PING also waits for every rank's answer)."""
    timeout = peer_timeout_s() if timeout is None else timeout
    header = torch.zeros(HEADER, dtype=torch.int64)
    n = 0 if body is None else body.numel()
    header[:2 + len(fields)] = torch.tensor([kind, n, *fields], dtype=torch.int64)
    broadcast(header.to(device), timeout)
    if n:
        broadcast(body, timeout)
    if kind == PING:
        _ack(device, timeout)


def receive(device: torch.device, limits: MessageLimits,
            timeout: float | None = None) -> tuple[int, list[int], torch.Tensor | None]:
    """Ranks > 0: (kind, the header's fields after the length, body or None). The header is
    checked against `limits` before the body is allocated (MessageError); a PING is answered."""
    timeout = peer_timeout_s() if timeout is None else timeout
    header = torch.empty(HEADER, dtype=torch.int64, device=device)
    broadcast(header, timeout)
    kind, n, *fields = header.tolist()
    limits.check_header(kind, n, fields)
    body = None
    if n:
        body = torch.empty(n, dtype=torch.int64, device=device)
        broadcast(body, timeout)
    if kind == PING:
        _ack(device, timeout)
    return kind, fields, body


class Collectives:
    """What a rank's network calls between its shards: the all-reduce after o_proj and down, the
    logits' all-gather, each bounded by the peer timeout. Counts calls, bytes and seconds
    (scripts/bench_tp.py reads them)."""

    def __init__(self, shard: TPShard, vocab_size: int):
        self.shard, self.vocab_size = shard, vocab_size
        self.timeout = peer_timeout_s()
        self.reduce_calls = self.reduce_bytes = 0
        self.reduce_seconds = 0.0
        self.gather_calls = self.gather_bytes = 0
        self.gather_seconds = 0.0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        all_reduce(t, self.timeout)
        self.reduce_seconds += time.perf_counter() - start
        self.reduce_calls += 1
        self.reduce_bytes += t.numel() * t.element_size()
        return t

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        pad = self.shard.vocab_per_rank - logits.shape[1]  # the last slice may be shorter
        part = (F.pad(logits, (0, pad)) if pad else logits).contiguous()
        parts = [torch.empty_like(part) for _ in range(self.shard.size)]
        all_gather(parts, part, self.timeout)
        out = torch.cat(parts, dim=1)[:, :self.vocab_size]
        self.gather_seconds += time.perf_counter() - start
        self.gather_calls += 1
        self.gather_bytes += part.numel() * part.element_size() * self.shard.size
        return out

    def reset(self) -> None:
        self.__init__(self.shard, self.vocab_size)
