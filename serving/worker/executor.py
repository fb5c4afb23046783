"""Executors: run one iteration's packed batch on an engine and return the sampled rows' logits.

The schedule→execute→update loop (engine.py) is written once; an executor is the strategy it
plugs in — the torch network (network_executor.py), a TensorRT execution context in
trt_executor.py, or rank 0 of a tensor-parallel group (tp_executor.py). `make_executor` picks one.
"""

from __future__ import annotations

import torch

from trtforge.models.engine_dir import EngineConfig
from trtforge.models.loader import load_network
from trtforge.serving.worker.network_executor import Executor, NetworkExecutor


def make_executor(engine_dir: str, cfg: EngineConfig, num_blocks: int, device: str | torch.device,
                  cuda_graph_batch_sizes: tuple[int, ...] = ()) -> Executor:
    """The executor engine.json's backend asks for (TensorRT explains what is missing when it can't load)."""
    if cfg.tp_size > 1:  # rank 0 of several (docs/scale-out.md); it starts or waits for the others
        if cuda_graph_batch_sizes:
            raise ValueError("CUDA graphs are not supported with tensor parallelism (tp_size > 1) yet: run "
                             "without --cuda-graphs.")
        from trtforge.serving.worker.tp_executor import TensorParallelExecutor

        return TensorParallelExecutor(engine_dir, cfg, num_blocks, device)
    if cfg.backend == "tensorrt":
        from trtforge.serving.worker.trt_executor import TensorRTNetwork

        return NetworkExecutor(TensorRTNetwork.from_engine_dir(engine_dir), cfg, num_blocks, "cuda")
    network = load_network(engine_dir, cfg, device, kernels="auto")  # the kernels registry's choice for device
    return NetworkExecutor(network, cfg, num_blocks, device, cuda_graph_batch_sizes)


__all__ = ["Executor", "NetworkExecutor", "make_executor"]
