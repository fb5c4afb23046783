"""The network's linear layers on CPU (float32): a C GEMV for decode-sized batches, oneDNN beyond.

Why not `F.linear`: PyTorch's CPU `F.linear` calls MKL, whose fp32 GEMM for LLM shapes is slow on
AMD processors and barely uses a second thread (2-core AMD EPYC, [16 × 896] × [896 × 9728]:
14.2 ms vs 6.1 ms through oneDNN; 3.8 vs 2.0 ms at one row).

Why a C GEMV for up to `GEMV_MAX_ROWS` rows (`linear.c`): a decode step mostly streams the
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

Which layers use it: the kernels registry (plugins/kernels.py) chooses "cpu" linears for float32
on CPU where this torch has oneDNN's linear (`onednn_available`), unless `TRTFORGE_CPU_ONEDNN=0`
(plain `F.linear`); the network is then built with a `CpuLinear` for every linear layer and the LM
head runs `cpu_linear` on its weight, the embedding table itself when tied (models/layers.py).
`TRTFORGE_CPU_NATIVE=0` keeps oneDNN but not the C kernel. All give the same results up to float32
summation order.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import nn

from trtforge.plugins import native
from trtforge.plugins.cpu.fused import native_ok

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


def onednn_available() -> bool:
    """Whether this torch has oneDNN's linear (`torch.ops.mkldnn._linear_pointwise`)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear through oneDNN (x contiguous float32 CPU; see onednn_available), rows padded to
    a multiple of ONEDNN_ROW_QUANTUM (the padding rows are zeros, computed and dropped)."""
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    pad = -rows % ONEDNN_ROW_QUANTUM
    if not pad:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    flat = torch.nn.functional.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, pad))
    y = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "")[:rows]
    return y.reshape(*x.shape[:-1], weight.shape[0])


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x W^T + b, float32 on CPU, W dense contiguous [out, in]: the C GEMV for up to
    GEMV_MAX_ROWS rows (in eager inference, K a multiple of 8, kernel built), oneDNN otherwise."""
    out_features, in_features = weight.shape
    rows = x.numel() // in_features if x.dim() else 0
    if rows <= GEMV_MAX_ROWS and in_features % 8 == 0 and native_ok(x) and library() is not None:
        y = x.new_empty((*x.shape[:-1], out_features))
        LIBRARY.lib.trtforge_gemv(  # type: ignore[union-attr]
            x.data_ptr(), rows, weight.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
            out_features, in_features, torch.get_num_threads())
        return y
    if not x.is_contiguous():
        x = x.contiguous()
    return onednn_linear(x, weight, bias)


class CpuLinear(nn.Module):
    """y = x W^T + b through `cpu_linear`, float32 on CPU, W dense [out, in] (buffers `weight`,
    `bias`: the state-dict names of nn.Linear); shares the tensors it is given."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.detach().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().contiguous())
        self.register_load_state_dict_post_hook(_keep_contiguous)

    @classmethod
    def empty(cls, in_features: int, out_features: int, bias: bool) -> "CpuLinear":
        """Uninitialised, for a network whose weights are loaded afterwards (on meta: no storage)."""
        return cls(torch.empty(out_features, in_features), torch.empty(out_features) if bias else None)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_linear(x, self.weight, self.bias)


def _keep_contiguous(module: CpuLinear, _incompatible) -> None:
    """The C GEMV reads W and b by raw pointer: loaded tensors must be dense (safetensors' are)."""
    for name in ("weight", "bias"):
        t = getattr(module, name)
        if t is not None and not t.is_meta and not t.is_contiguous():
            setattr(module, name, t.contiguous())


__all__ = ["CpuLinear", "GEMV_MAX_ROWS", "cpu_linear", "onednn_available", "onednn_linear"]
