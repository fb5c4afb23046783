"""One tensor-parallel rank's network and KV pool, the same on rank 0 and on the others.

The rank's network (its heads, MLP slice and vocabulary slice: builder/tensor_parallel.py) runs
in a NetworkExecutor over a KV pool of its own KV heads, with the collectives attached. The block
count is rank 0's (sent at INIT), so every rank's pool takes the same block tables. The CPU decode
plan is off: it calls the C kernels layer by layer and has no place for the all-reduce; the C
kernels themselves (fused norms, RoPE, GEMV, paged attention) run inside the network as at tp 1.
"""

from __future__ import annotations

import dataclasses

import torch

from trtforge.models.engine_dir import EngineConfig
from trtforge.models.dtypes import torch_dtype
from trtforge.models.loader import load_network
from trtforge.models.tensor_parallel import local_config, shard_of
from trtforge.plugins.cpu.linear import cpu_linears_wanted, use_cpu_linears

from trtforge.serving.worker.executor import NetworkExecutor
from trtforge.serving.worker.tp_comm import Collectives


def load_rank(engine_dir: str, cfg: EngineConfig, rank: int, num_blocks: int,
              device: torch.device) -> tuple[NetworkExecutor, Collectives]:
    shard = shard_of(cfg.model, cfg.tp_size, rank)
    network = load_network(engine_dir, cfg, device, rank=rank)
    if cpu_linears_wanted(device, torch_dtype(cfg.dtype)):
        use_cpu_linears(network)
    collectives = Collectives(shard, cfg.model.vocab_size)
    network.attach_collectives(collectives.all_reduce, collectives.gather_vocab)
    local = dataclasses.replace(cfg, model=local_config(cfg.model, shard))  # the pool holds this rank's KV heads
    return NetworkExecutor(network, local, num_blocks, device), collectives  # no CPU decode plan for a shard
