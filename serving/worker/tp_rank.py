"""One tensor-parallel rank's network and KV pool, the same on rank 0 and on the others.

The rank's network (its heads, MLP slice and vocabulary slice: models/tensor_parallel.py) runs
in a NetworkExecutor over a KV pool of its own KV heads, with the collectives attached. The block
count is rank 0's (sent at INIT), so every rank's pool takes the same block tables. The CPU decode
plan is off: it calls the C kernels layer by layer and has no place for the all-reduce; the C
kernels themselves (fused norms, RoPE, GEMV, paged attention) run inside the network as at tp 1.
The device and thread count of a rank (`rank_device`, `cpu_threads`) are here too: rank 0
(tp_executor.py) and the other ranks (tp_worker.py) share them.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from trtforge.models.engine_dir import EngineConfig
from trtforge.models.loader import load_network
from trtforge.models.tensor_parallel import local_config, shard_of
from trtforge.serving.worker.network_executor import NetworkExecutor
from trtforge.serving.worker.tp_comm import Collectives
from trtforge.serving.worker.tp_launch import THREADS_ENV, Launch


def cpu_threads(launch: Launch) -> int:
    """This host's cores divided among the ranks that run on it (TRTFORGE_TP_THREADS overrides)."""
    if os.environ.get(THREADS_ENV):
        return max(1, int(os.environ[THREADS_ENV]))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // launch.local_ranks)


def rank_device(device: str | torch.device, local_rank: int) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank if device.index is None else device.index + local_rank)
        torch.cuda.set_device(device)
    return device


def load_rank(engine_dir: str, cfg: EngineConfig, rank: int, num_blocks: int,
              device: torch.device) -> tuple[NetworkExecutor, Collectives]:
    shard = shard_of(cfg.model, cfg.tp_size, rank)
    network = load_network(engine_dir, cfg, device, rank=rank, kernels="auto")  # the registry's kernels, as at tp 1
    collectives = Collectives(shard, cfg.model.vocab_size)
    network.attach_collectives(collectives.all_reduce, collectives.gather_vocab)
    local = dataclasses.replace(cfg, model=local_config(cfg.model, shard))  # the pool holds this rank's KV heads
    return NetworkExecutor(network, local, num_blocks, device), collectives  # no CPU decode plan for a shard
