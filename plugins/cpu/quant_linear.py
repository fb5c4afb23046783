"""Weight-only quantisation (int8 per output channel, int4 per group of inputs): the math and its kernels.

Symmetric round-to-nearest: a row (int8) or a group of `group` inputs of a row (int4) is divided by
scale = max|w| / qmax (qmax 127 or 7) and rounded, so every weight is off by at most scale / 2.
int4 values are stored two per byte, element 2i in the low nibble of byte i and 2i+1 in the high
one (two's complement nibbles). Scales are float32.

The references here (`dequantize`, then any matmul) define the results; quant_linear.c computes the
same products without materialising float32 weights: `gemv` for decode-sized batches (≤ 32 rows,
float32, CPU) and `dequantize_into` (OpenMP) for a dense GEMM on longer inputs. The kernels' values
are the references' up to float32 summation order (tests/plugins/cpu/test_quant_linear.py).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from trtforge.plugins import native

from .fused import native_ok

SCHEMES = ("int8_wo", "int4_wo")
QMAX = {"int8_wo": 127, "int4_wo": 7}

_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {"trtforge_gemv_int8": (None, [_P, _I, _P, _P, _P, _P, _I, _I, _I]),
               "trtforge_gemv_int4": (None, [_P, _I, _P, _P, _P, _P, _I, _I, _I, _I]),
               "trtforge_dequant_int8": (None, [_P, _P, _P, _I, _I, _I]),
               "trtforge_dequant_int4": (None, [_P, _P, _P, _I, _I, _I, _I])}
LIBRARY = native.NativeLibrary(Path(__file__).with_name("quant_linear.c"), _SIGNATURES,
                               extra_flags=("-fopenmp", "-ffp-contract=fast"))
library = LIBRARY.get  # the library, or None where it cannot be built (then the torch references run)


# ---- quantise / pack (build time) and dequantise (the reference) -----------------------------------
def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] with values in [-8, 7], K even → uint8 [N, K/2]."""
    nib = (q.to(torch.int16) & 0xF).to(torch.uint8)
    return nib[:, 0::2] | (nib[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] → int8 [N, K] (the inverse of pack_int4)."""
    nib = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1).to(torch.int8)
    return nib - ((nib & 8) << 1)  # two's complement: 8..15 → -8..-1


def quantize(weight: torch.Tensor, scheme: str, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] (any float dtype; quantised from its float32 values) → (qweight, scales):
    int8_wo: int8 [N, K], float32 [N]; int4_wo: uint8 [N, K/2], float32 [N, K/group]."""
    w = weight.detach().float()
    n, k = w.shape
    blocks = w.view(n, 1, k) if scheme == "int8_wo" else w.view(n, k // group, group)
    scale = blocks.abs().amax(dim=-1) / QMAX[scheme]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block: any scale is exact
    q = torch.round(blocks / scale.unsqueeze(-1)).clamp_(-QMAX[scheme], QMAX[scheme]).to(torch.int8).view(n, k)
    if scheme == "int8_wo":
        return q, scale.view(n)
    return pack_int4(q), scale


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, scheme: str, group: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The reference: float weights [N, K] (computed in float32, then cast to `dtype`)."""
    if scheme == "int8_wo":
        return (qweight.float() * scales.unsqueeze(1)).to(dtype)
    q = unpack_int4(qweight).float()
    n, k = q.shape
    return (q.view(n, k // group, group) * scales.unsqueeze(-1)).view(n, k).to(dtype)


# ---- the kernels ---------------------------------------------------------------------------------
def kernel_ok(x: torch.Tensor, in_features: int, group: int) -> bool:
    """Whether quant_linear.c takes this product: float32 CPU eager inference, K and group multiples of 8."""
    return in_features % 8 == 0 and group % 8 == 0 and native_ok(x) and library() is not None


def gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
         scheme: str, group: int) -> torch.Tensor:
    """y = x dequantize(W)^T + b through the C kernel; x float32 contiguous [..., K] (kernel_ok)."""
    k = x.shape[-1]
    rows, n = x.numel() // k, scales.shape[0]
    y = x.new_empty((*x.shape[:-1], n))
    lib = LIBRARY.lib
    args = (x.data_ptr(), rows, qweight.data_ptr(), scales.data_ptr(),
            None if bias is None else bias.data_ptr(), y.data_ptr(), n, k)
    if scheme == "int8_wo":
        lib.trtforge_gemv_int8(*args, torch.get_num_threads())  # type: ignore[union-attr]
    else:
        lib.trtforge_gemv_int4(*args, group, torch.get_num_threads())  # type: ignore[union-attr]
    return y


def dequantize_into(out: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, scheme: str,
                    group: int) -> torch.Tensor:
    """`dequantize` (float32) written into `out` ([N, K] contiguous float32) by the C kernel."""
    n, k = out.shape
    lib = LIBRARY.lib
    if scheme == "int8_wo":
        lib.trtforge_dequant_int8(qweight.data_ptr(), scales.data_ptr(), out.data_ptr(), n, k,  # type: ignore[union-attr]
                                  torch.get_num_threads())
    else:
        lib.trtforge_dequant_int4(qweight.data_ptr(), scales.data_ptr(), out.data_ptr(), n, k, group,  # type: ignore[union-attr]
                                  torch.get_num_threads())
    return out


__all__ = ["QMAX", "SCHEMES", "dequantize", "dequantize_into", "gemv", "kernel_ok", "pack_int4", "quantize",
           "unpack_int4"]
