"""The executor of one network: its per-layer paged KV pools, CUDA graphs or the CPU decode plan.

Apart from executor.py (`make_executor`, which picks an executor) so that the tensor-parallel rank
(tp_rank.py) can run one without importing the module that imports it.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from trtforge.models.dtypes import torch_dtype
from trtforge.models.engine_dir import EngineConfig
from trtforge.serving.worker.cpu_decode_plan import CpuDecodePlan
from trtforge.serving.worker.kv_pool import zeroed_pool
from trtforge.serving.worker.model_inputs import ModelInputs


class Executor(Protocol):
    device: torch.device

    def execute(self, inputs: ModelInputs) -> torch.Tensor:
        """float32 logits [len(inputs.logits_indices), vocab]."""


class NetworkExecutor:
    """Runs a network — trtforge's torch CausalLM (models/network.py) or a TensorRT plan with the same
    call signature (trt_executor.TensorRTNetwork) — over per-layer paged KV pools it owns."""

    def __init__(self, network: Any, cfg: EngineConfig, num_blocks: int, device: str | torch.device = "cpu",
                 cuda_graph_batch_sizes: tuple[int, ...] = ()):
        self.device = torch.device(device)
        self.network = network
        m = cfg.model
        graphs = bool(cuda_graph_batch_sizes)
        if graphs and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need --device cuda (got {self.device}).")
        # One pool per layer, [2 (K,V), blocks, block_size, Hkv, D]: see plugins/paged_attention/metadata.py.
        # With CUDA graphs one more block exists, never handed out: the padding rows' scratch.
        shape = (2, num_blocks + graphs, cfg.block_size, m.num_kv_heads, m.head_dim)
        int8_kv = cfg.kv_cache_dtype == "int8"
        if int8_kv and self.device.type != "cpu":
            raise ValueError(f"this engine keeps its KV cache in int8 (--kv-cache-dtype int8), which only the CPU "
                             f"attention kernels read; run it with --device cpu, or rebuild without "
                             f"--kv-cache-dtype int8 for {self.device.type}.")
        kv_dtype = torch.int8 if int8_kv else torch_dtype(cfg.dtype)
        self.kv_caches = [zeroed_pool(shape, kv_dtype, self.device) for _ in range(m.num_layers)]
        self.kv_scales = [zeroed_pool(shape[:4], torch.float32, self.device) for _ in range(m.num_layers)] \
            if int8_kv else None
        """int8 KV: per layer its float32 scales [2, blocks, block_size, Hkv] (plugins/paged_attention/op.py)."""
        self.graphs = None
        if graphs:
            from trtforge.serving.worker.cuda_graphs import CudaGraphRunner

            self.graphs = CudaGraphRunner(network, self.kv_caches, cuda_graph_batch_sizes,
                                          -(-cfg.max_seq_len // cfg.block_size), num_blocks, cfg.block_size)

        self.cpu_plan = CpuDecodePlan.build(network, self.kv_caches, self.kv_scales) \
            if self.device.type == "cpu" else None
        """Small float32 decode steps on CPU as a fixed list of C kernel calls (cpu_decode_plan.py)."""

    def describe(self) -> str:
        """Which execution paths this executor uses, for the startup log."""
        parts = [f"{self.device.type}, {self.kv_caches[0].dtype}".replace("torch.", "")]
        if self.graphs is not None:
            parts.append(f"CUDA graphs for decode batches {self.graphs.batch_sizes}")
        if self.device.type == "cpu":
            from trtforge.plugins.cpu import fused as cpu_fused, linear as cpu_linear
            from trtforge.plugins.paged_attention import cpu_native

            native = {"fused ops": cpu_fused.library(), "packed GEMM": cpu_linear.library(),
                      "decode attention": cpu_native.library()}
            parts.append("C kernels: " + ", ".join(f"{k} {'on' if v is not None else 'OFF'}"
                                                   for k, v in native.items()))
            parts.append("CPU decode plan: " + ("on" if self.cpu_plan is not None else "off"))
        built_with = getattr(self.network, "built_with", None)
        if built_with is not None:
            parts.append(built_with.describe())
        quant = getattr(self.network, "cfg", None) and _quantization(self.network)
        if quant:
            parts.append(quant)
        return "; ".join(parts)

    @torch.inference_mode()
    def execute(self, inputs: ModelInputs) -> torch.Tensor:
        if self.graphs is not None and self.graphs.can_run(inputs):
            return self.graphs.run(inputs)
        if self.cpu_plan is not None and self.cpu_plan.can_run(inputs):
            return self.cpu_plan.run(inputs)
        return self.network(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta,
                            inputs.logits_indices, **({} if self.kv_scales is None else {"kv_scales": self.kv_scales}))


def _quantization(network: Any) -> str | None:
    """'int4_wo weights (group 128): C kernel on|OFF' for a quantized torch network, else None."""
    from trtforge.models.quantized_layers import QuantLinear
    from trtforge.plugins.cpu import quant_linear as cpu_quant

    layers = [m for m in network.modules() if isinstance(m, QuantLinear)]
    if not layers:
        return None
    group = f" (group {layers[0].group})" if layers[0].group else ""
    kernel = ("quantized GEMV " + ("on" if cpu_quant.library() is not None else "OFF") if layers[0].native
              else "torch reference (dequantise + matmul)")
    extras = [name for name, attr in (("zero points", "zeros"), ("act-order", "perm"))
              if any(getattr(m, attr) is not None for m in layers)]
    kernel += f" + {' and '.join(extras)}" if extras else ""
    return f"{layers[0].scheme} weights{group}: {kernel}"
