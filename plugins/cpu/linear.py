"""The network's linear layers on CPU (float32): a C GEMV for decode-sized batches, oneDNN beyond.

Why not `F.linear`: PyTorch's CPU `F.linear` calls MKL, whose fp32 GEMM for LLM shapes is slow on
AMD processors and barely uses a second thread (2-core AMD EPYC, [16 × 896] × [896 × 9728]:
14.2 ms vs 6.1 ms through oneDNN; 3.8 vs 2.0 ms at one row).

Why a C GEMV for up to `GEMV_MAX_ROWS` rows (`cpu_linear.c`): a decode step mostly streams the
weights, and oneDNN's kernel for a handful of rows re-reads them. Measured on that machine, 6 layers
of Qwen2.5-0.5B's linears (0.23 GB), oneDNN vs the C kernel, ms:

    rows               1     8    16    24    32    48
    2 threads  oneDNN 25.8  56.3  68.6  81.2  87.5  99.8
               C      20.3  32.4  48.9  66.0  73.3  87.6
    1 thread   oneDNN 31.4  80.5 103   125   131   167
               C      27.1  53.2  76.3  99.9 134   184

Its small products (qkv, o_proj: 3–4 MB) also run nearer memory speed than oneDNN's.

Why dense weights: oneDNN's `_linear_pointwise` takes the plain [N, K] weight as fast as one
pre-packed into its blocked layout (`_reorder_linear_weight`; measured equal within noise from 1
to 256 rows), so one dense copy serves both kernels, and a tied LM head reads the embedding table
itself instead of a second copy of it.

`TRTFORGE_CPU_ONEDNN=0` turns all of this off (plain `F.linear`); `TRTFORGE_CPU_NATIVE=0` keeps
oneDNN but not the C kernel. Both give the same results up to float32 summation order.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch
from torch import nn

from trtforge.plugins import native

from trtforge.plugins.cpu.fused import native_ok

ENV_VAR = "TRTFORGE_CPU_ONEDNN"
GEMV_MAX_ROWS = 32
"""Most rows (tokens) a product sends to the C kernel; more go to oneDNN (measured crossover: ~48
rows with 2 threads, ~30 with 1)."""

_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {"trtforge_gemv": (None, [_P, _I, _P, _P, _P, _I, _I, _I])}
LIBRARY = native.NativeLibrary(Path(__file__).with_name("linear.c"), _SIGNATURES,
                               extra_flags=("-fopenmp", "-ffp-contract=fast"))
library = LIBRARY.get  # the library, or None where it cannot be built (then oneDNN runs)


ONEDNN_ROW_QUANTUM = 32
"""oneDNN compiles and caches a kernel ("primitive") per row count: a server whose prefill steps
take every count from 33 to max_num_tokens kept ~420 MiB of them for a 0.5B model, and its memory
grew for thousands of requests (soak: +89 MiB from request 1k to 10k). Rows are padded to a
multiple of this, so at most max_num_tokens / 32 shapes exist (soak: +5 MiB)."""


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear through oneDNN (x contiguous float32 CPU; see cpu_linears_wanted), rows padded to
    a multiple of ONEDNN_ROW_QUANTUM (the padding rows are zeros, computed and dropped)."""
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    pad = -rows % ONEDNN_ROW_QUANTUM
    if not pad:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    flat = torch.nn.functional.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, pad))
    y = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "")[:rows]
    return y.reshape(*x.shape[:-1], weight.shape[0])


class CpuLinear(nn.Module):
    """y = x W^T + b, float32 on CPU, W dense [out, in]; shares the tensors it is given."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.detach().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().contiguous())
        self._gemv_ok = self.in_features % 8 == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features if x.dim() else 0
        if self._gemv_ok and rows <= GEMV_MAX_ROWS and native_ok(x) and library() is not None:
            y = x.new_empty((*x.shape[:-1], self.out_features))
            LIBRARY.lib.trtforge_gemv(  # type: ignore[union-attr]
                x.data_ptr(), rows, self.weight.data_ptr(),
                None if self.bias is None else self.bias.data_ptr(), y.data_ptr(),
                self.out_features, self.in_features, torch.get_num_threads())
            return y
        if not x.is_contiguous():
            x = x.contiguous()
        return onednn_linear(x, self.weight, self.bias)


def cpu_linears_wanted(device: torch.device, dtype: torch.dtype) -> bool:
    """For float32 on CPU, unless TRTFORGE_CPU_ONEDNN=0 or this torch lacks oneDNN's linear."""
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise") and os.environ.get(ENV_VAR, "1") != "0")


def use_cpu_linears(network: nn.Module) -> nn.Module:
    """Replace every nn.Linear of `network` by a CpuLinear on the same tensors, and give it a
    CpuLinear LM head (on the embedding table itself when tied), in place. A head the network
    already has (a quantized one: builder/quant_linear.py) stays."""
    if network.head_linear is None:
        network.head_linear = CpuLinear(network.lm_head_weight(), None)
        if not network.cfg.tie_word_embeddings:
            del network.lm_head  # head_linear holds the same tensor
    for parent in list(network.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, CpuLinear(child.weight, child.bias))
    return network


__all__ = ["CpuLinear", "GEMV_MAX_ROWS", "cpu_linears_wanted", "onednn_linear", "use_cpu_linears"]
