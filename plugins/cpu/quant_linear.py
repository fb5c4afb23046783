"""Weight-only quantisation (int8 per output channel, int4 per group of inputs): the math and its kernels.

Symmetric round-to-nearest: a row (int8) or a group of `group` inputs of a row (int4) is divided by
a scale and rounded — int8: scale = max|w| / 127, so every weight is off by at most scale / 2; int4:
codes in [-8, 7], the scale per group the one of INT4_CLIP's candidates (max|w| / 7 and finer ones
that clip the extremes) with the least squared error.
int4 values are stored two per byte, element 2i in the low nibble of byte i and 2i+1 in the high
one (two's complement nibbles). Scales are float32.

The references here (`dequantize`, then any matmul) define the results; quant_linear.c computes the
same products without materialising float32 weights: `gemv` (float32, CPU; float activations: for
decode-sized batches, ≤ 32 rows) and `dequantize_into` (OpenMP) for a dense GEMM on longer inputs with
float activations. The kernels' values are the references' up to float32 summation order
(tests/plugins/cpu/test_quant_linear.py).

By default `gemv` quantises the activations too (W8A8 / W4A8), at any row count — decode steps and
prefill chunks (a QuantLinear does what the kernels registry chose for it, plugins/kernels.py:
`TRTFORGE_QUANT_ACTIVATIONS=float` keeps the float-activation kernels): each row of
x per block of 32 inputs to int8 (symmetric,
d = max|x| / 127, round half to even: `quantize_activations`), integer dot products per block, times
d and the weight scale — `gemv_a8_reference` in torch, which the C kernel matches up to float32
summation order. Each activation is then off by at most d / 2 (docs/quantization.md: the accuracy
cost). K and the int4 group must be multiples of 32 for it (`a8_ok`); other shapes take the
float-activation kernels.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from trtforge.plugins import native
from trtforge.plugins.cpu.fused import native_ok

SCHEMES = ("int8_wo", "int4_wo")
QMAX = {"int8_wo": 127, "int4_wo": 7}
GEMV_MAX_ROWS = 32
"""Most rows the float-activation GEMVs take in one call (they re-read the weights per few rows:
beyond this, prefill dequantises the layer and runs a GEMM; a head that must not be dequantised
runs the GEMV this many rows at a time)."""

_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {"trtforge_gemv_int8": (None, [_P, _I, _P, _P, _P, _P, _I, _I, _I]),
               "trtforge_gemv_int4": (None, [_P, _I, _P, _P, _P, _P, _I, _I, _I, _I]),
               "trtforge_gemv_int8_a8": (ctypes.c_int, [_P, _I, _P, _P, _P, _P, _I, _I, _I]),
               "trtforge_gemv_int4_a8": (ctypes.c_int, [_P, _I, _P, _P, _P, _P, _I, _I, _I, _I]),
               "trtforge_quantize_activations": (None, [_P, _I, _I, _P, _P]),
               "trtforge_dequant_int8": (None, [_P, _P, _P, _I, _I, _I]),
               "trtforge_dequant_int4": (None, [_P, _P, _P, _I, _I, _I, _I]),
               "trtforge_vnni": (ctypes.c_int, []),
               "trtforge_int8_panels": (ctypes.c_int, []),
               "trtforge_pack_int8_vnni": (ctypes.c_int, [_P, _I, _I, _P, _P, _I]),
               "trtforge_gemm_int8_vnni": (ctypes.c_int, [_P, _I, _P, _P, _P, _P, _P, _I, _I, _I]),
               "trtforge_gather_columns": (None, [_P, _I, _I, _P, _P]),
               "trtforge_zero_point_correction": (ctypes.c_int, [_P, _I, _I, _I, _P, _P, _I, _I])}
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


INT4_CLIP = (1.0, 0.975, 0.95, 0.925, 0.9, 0.875, 0.85, 0.825, 0.8, 0.775, 0.75)
"""int4 scale candidates, as fractions of max|w| / 7: each group keeps the one with the least squared
error. Below 1 the group's largest weights are clipped to 7 (or -8) steps, and every other weight
gets a finer step; 0.875 = max|w| / 8 puts a negative extreme exactly on -8. (A clipping search as
llama.cpp's k-quants and AWQ do; the format is unchanged: symmetric codes in [-8, 7], one float32
scale per group.) On Gaussian weights, groups of 128: the mean squared error is ~20 % below plain
round-to-nearest (tests/plugins/cpu/test_quant_linear.py checks that it is never above it)."""


def _int4_codes(blocks: torch.Tensor, base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 [n, G, group], scales [n, G]): per group the INT4_CLIP candidate with the least error."""
    best_q, best_s, best_err = None, base, None
    for frac in INT4_CLIP:
        s = base * frac
        q = torch.round(blocks / s.unsqueeze(-1)).clamp_(-8, 7)
        err = (q * s.unsqueeze(-1) - blocks).square_().sum(-1)
        if best_q is None:
            best_q, best_s, best_err = q, s, err
            continue
        better = err < best_err
        best_q = torch.where(better.unsqueeze(-1), q, best_q)
        best_s, best_err = torch.where(better, s, best_s), torch.where(better, err, best_err)
    return best_q.to(torch.int8), best_s


def quantize(weight: torch.Tensor, scheme: str, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] (any float dtype; quantised from its float32 values) → (qweight, scales):
    int8_wo: int8 [N, K], float32 [N] (round to nearest, scale max|w| / 127); int4_wo: uint8 [N, K/2],
    float32 [N, K/group] (the scale per group searched over INT4_CLIP)."""
    w = weight.detach().float()
    n, k = w.shape
    blocks = w.view(n, 1, k) if scheme == "int8_wo" else w.view(n, k // group, group)
    scale = blocks.abs().amax(dim=-1) / QMAX[scheme]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block: any scale is exact
    if scheme == "int8_wo":
        q = torch.round(blocks / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8).view(n, k)
        return q, scale.view(n)
    rows = max(1, (1 << 22) // k)  # bounded temporaries: ~4M weights at a time
    parts = [_int4_codes(blocks[i:i + rows], scale[i:i + rows]) for i in range(0, n, rows)]
    q = torch.cat([p[0] for p in parts]).view(n, k)
    return pack_int4(q), torch.cat([p[1] for p in parts])


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, scheme: str, group: int,
               dtype: torch.dtype = torch.float32, zeros: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: float weights [N, K] (computed in float32, then cast to `dtype`). zeros (int8 [N]
    for int8_wo, [N, K/group] for int4_wo; pre-quantized asymmetric checkpoints): w = (q - zero) · scale,
    the integer difference first, so each weight is one exact product."""
    q = (qweight if scheme == "int8_wo" else unpack_int4(qweight)).to(torch.int32)
    n, k = q.shape
    g = k if scheme == "int8_wo" else group
    q = q.view(n, k // g, g)
    if zeros is not None:
        q = q - zeros.to(torch.int32).view(n, k // g, 1)
    return (q.float() * scales.view(n, k // g, 1)).view(n, k).to(dtype)


def zero_point_correction(x: torch.Tensor, zero_scales: torch.Tensor) -> torch.Tensor:
    """What zero points take off a product whose kernel saw the codes alone: with w = (q - z) · s,
    x·wᵀ = x·(q·s)ᵀ - Σ_g (s·z)[n, g] · Σ_{i in group g} x[i]. zero_scales: float32 [N, G] = s·z (exact:
    a small integer times a scale); x [rows, K] → [rows, N]."""
    rows, k = x.shape
    g = zero_scales.shape[1]
    return x.float().view(rows, g, k // g).sum(-1) @ zero_scales.t()


def zero_point_correction_into(y: torch.Tensor, x: torch.Tensor, zero_scales_t: torch.Tensor,
                               lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """y -= `zero_point_correction`(x, zero_scales_t.t()) in place by the C helper (quant_linear.c): x float32
    contiguous [rows, K] (K / groups a multiple of 8), y [rows, N] contiguous, zero_scales_t float32 [G, N]
    contiguous (s·z transposed, as `QuantLinear.zero_scales_t` keeps it). Returns y."""
    lib = lib or LIBRARY.lib
    rows, k = x.shape
    if lib.trtforge_zero_point_correction(x.data_ptr(), rows, k, zero_scales_t.shape[0], zero_scales_t.data_ptr(),  # type: ignore[union-attr]
                                          y.data_ptr(), y.shape[1], torch.get_num_threads()):
        raise MemoryError("zero-point correction: no memory for the group sums")
    return y


def gather_columns(x: torch.Tensor, perm: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x[:, perm] by the C helper: x float32 contiguous [rows, K], perm int64 [K] (GPTQ act-order's input order)."""
    lib = lib or LIBRARY.lib
    out = torch.empty_like(x)
    lib.trtforge_gather_columns(x.data_ptr(), x.shape[0], x.shape[1], perm.data_ptr(), out.data_ptr())  # type: ignore[union-attr]
    return out


# ---- activations quantised too (decode): the reference -------------------------------------------
ACT_BLOCK = 32


def a8_ok(in_features: int, scheme: str, group: int) -> bool:
    """Whether the int8-activation kernel takes this layer's shape: K (and the int4 group) multiples of 32.
    (Whether a layer uses it where it may is the kernels registry's `quant_activations`.)"""
    return in_features % ACT_BLOCK == 0 and (scheme == "int8_wo" or group % ACT_BLOCK == 0)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x float32 [rows, K] (K a multiple of 32) → (int8 [rows, K], float32 [rows, K/32]): per block of 32,
    d = max|x| / 127 (1 for an all-zero block), q = round-half-even(x / d) — the C kernel's arithmetic."""
    rows, k = x.shape
    blocks = x.float().view(rows, k // ACT_BLOCK, ACT_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    d = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.round(blocks / d.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8).view(rows, k)
    return q, d


def gemv_a8_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                      scheme: str, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the int8-activation GEMV computes, in float64 (every block's integer dot exact): (y, m) where
    y = Σ_blocks d[r, b] · (xq[r, b] · q[n, b]) · weight scale + bias and m the same sum of absolute
    values (|terms|, |bias|): a float32 evaluation in any order is within ~(#terms on a path)·2⁻²⁴·m."""
    xq, d = quantize_activations(x.reshape(-1, x.shape[-1]))
    rows, k = xq.shape
    nb = k // ACT_BLOCK
    q = qweight if scheme == "int8_wo" else unpack_int4(qweight)
    n = q.shape[0]
    dots = torch.einsum("rbi,nbi->rnb", xq.double().view(rows, nb, ACT_BLOCK), q.double().view(n, nb, ACT_BLOCK))
    abs_dots = torch.einsum("rbi,nbi->rnb", xq.double().abs().view(rows, nb, ACT_BLOCK),
                            q.double().abs().view(n, nb, ACT_BLOCK))
    if scheme == "int8_wo":
        ws = scales.double().view(1, n, 1)
    else:
        ws = scales.double().repeat_interleave(group // ACT_BLOCK, dim=1).view(1, n, nb)
    f = d.double().view(rows, 1, nb) * ws
    b = 0 if bias is None else bias.double()
    babs = 0 if bias is None else bias.double().abs()
    y, m = (dots * f).sum(-1) + b, (abs_dots * f.abs()).sum(-1) + babs
    return y.view(*x.shape[:-1], n), m.view(*x.shape[:-1], n)


# ---- the kernels ---------------------------------------------------------------------------------
def kernel_ok(x: torch.Tensor, in_features: int, group: int) -> bool:
    """Whether quant_linear.c takes this product: float32 CPU eager inference, K and group multiples of 8."""
    return in_features % 8 == 0 and group % 8 == 0 and native_ok(x) and library() is not None


def gemv_function(scheme: str, a8: bool) -> object:
    """The C GEMV of `scheme` with int8 activations (a8; it then returns nonzero when its scratch
    cannot be allocated) or float ones. Same arguments either way (int4: + group), threads last."""
    return getattr(LIBRARY.lib, f"trtforge_gemv_{scheme[:4]}{'_a8' if a8 else ''}")


def _output(x: torch.Tensor, n: int, out: torch.Tensor | None) -> torch.Tensor:
    """The kernels' y [..., n]: `out` checked (the C code writes it blindly) or a new tensor."""
    shape = (*x.shape[:-1], n)
    if out is None:
        return x.new_empty(shape)
    if out.shape != shape or out.dtype != torch.float32 or not out.is_contiguous() or out.device != x.device:
        raise ValueError(f"out must be a contiguous float32 tensor of shape {list(shape)} on {x.device}, "
                         f"got {out.dtype} {list(out.shape)}")
    return out


def gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
         scheme: str, group: int, activations: str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b through the C kernel; x float32 contiguous [..., K] (kernel_ok). activations:
    "int8" (quantised per block of 32: `gemv_a8_reference`; needs a8_ok's shapes), "float"
    (dequantize(W) exactly, up to summation order), None: int8 where `a8_ok` (the shape allows), else float.
    out: a contiguous float32 tensor of y's shape to write y into (a reused buffer, plugins/cpu/workspace.py)."""
    k = x.shape[-1]
    rows, n = x.numel() // k, scales.shape[0]
    y = _output(x, n, out)
    lib = LIBRARY.lib
    args = (x.data_ptr(), rows, qweight.data_ptr(), scales.data_ptr(),
            None if bias is None else bias.data_ptr(), y.data_ptr(), n, k)
    a8 = a8_ok(k, scheme, group) if activations is None else activations == "int8"
    if a8:
        if k % ACT_BLOCK or (scheme == "int4_wo" and group % ACT_BLOCK):
            raise ValueError(f"int8 activations need K and the int4 group to be multiples of {ACT_BLOCK} "
                             f"(K={k}, group={group})")
        fn = lib.trtforge_gemv_int8_a8 if scheme == "int8_wo" else lib.trtforge_gemv_int4_a8  # type: ignore[union-attr]
        extra = () if scheme == "int8_wo" else (group,)
        if fn(*args, *extra, torch.get_num_threads()):
            raise MemoryError("quantised GEMV: no memory for the int8 activation rows")
        return y
    if scheme == "int8_wo":
        lib.trtforge_gemv_int8(*args, torch.get_num_threads())  # type: ignore[union-attr]
    else:
        lib.trtforge_gemv_int4(*args, group, torch.get_num_threads())  # type: ignore[union-attr]
    return y


# ---- int8 x int8 on weights packed at load (quant_linear.c): AVX-512 VNNI, or AVX2 on the same layout --
def vnni_available(lib: ctypes.CDLL | None = None) -> bool:
    """Whether the library (default this process's) was built with the VNNI kernel (AVX-512 VNNI CPU)."""
    lib = lib or library()
    return lib is not None and lib.trtforge_vnni() == 1


def panels_kernel(lib: ctypes.CDLL | None = None) -> str | None:
    """Which kernel of the library (default this process's) reads VNNI-layout panels (`pack_int8_vnni`):
    "vnni" (AVX-512 VNNI builds), "avx2" (other AVX2 builds: vpsignb + vpmaddubsw + vpmaddwd on the
    same layout), None (portable builds: no packed int8 GEMM)."""
    lib = lib or library()
    return None if lib is None else {2: "vnni", 1: "avx2"}.get(lib.trtforge_int8_panels())


def pack_int8_vnni_reference(qweight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 W [N, K] in the VNNI kernel's layout, by torch: (packed int8 [panels, K/4, 16, 4] — per
    panel of 16 rows and group of 4 inputs, the 16 x 4 weights; zero rows past N — and wsum int32
    [panels, K/32, 16] = 128 x each row's sum over each block of 32 inputs)."""
    n, k = qweight.shape
    panels = -(-n // 16)
    q = torch.nn.functional.pad(qweight, (0, 0, 0, panels * 16 - n)).view(panels, 16, k // 4, 4)
    wsum = 128 * q.view(panels, 16, k // ACT_BLOCK, ACT_BLOCK).to(torch.int32).sum(-1)
    return q.permute(0, 2, 1, 3).contiguous(), wsum.permute(0, 2, 1).contiguous()


def unpack_int8_vnni(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The row-major int8 W [N, K] of a VNNI-packed weight (a copy)."""
    panels, quads, _, _ = packed.shape
    return packed.permute(0, 2, 1, 3).reshape(panels * 16, quads * 4)[:out_features].contiguous()


def pack_int8_vnni(qweight: torch.Tensor, lib: ctypes.CDLL | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack_int8_vnni_reference`'s layout, by the C kernel (needs `panels_kernel`)."""
    lib = lib or library()
    n, k = qweight.shape
    panels = -(-n // 16)
    packed = torch.empty(panels, k // 4, 16, 4, dtype=torch.int8)
    wsum = torch.empty(panels, k // ACT_BLOCK, 16, dtype=torch.int32)
    if lib.trtforge_pack_int8_vnni(qweight.contiguous().data_ptr(), n, k, packed.data_ptr(), wsum.data_ptr(),
                                   torch.get_num_threads()):
        raise RuntimeError("this build of quant_linear.c has no packed int8 GEMM (neither VNNI nor AVX2)")
    return packed, wsum


def gemm_int8_vnni(x: torch.Tensor, packed: torch.Tensor, wsum: torch.Tensor, scales: torch.Tensor,
                   bias: torch.Tensor | None, out_features: int, lib: ctypes.CDLL | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b with x quantised per block of 32 (`gemv_a8_reference`'s arithmetic) on the packed
    kernel (`panels_kernel`: VNNI, or AVX2 on the same layout); x float32 contiguous [..., K]
    (`kernel_ok`, K a multiple of 32); out as `gemv`'s."""
    lib = lib or LIBRARY.lib
    k = x.shape[-1]
    y = _output(x, out_features, out)
    rc = lib.trtforge_gemm_int8_vnni(x.data_ptr(), x.numel() // k, packed.data_ptr(), wsum.data_ptr(),  # type: ignore[union-attr]
                                     scales.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                                     out_features, k, torch.get_num_threads())
    if rc:
        raise MemoryError("int8 VNNI GEMM: no memory for the int8 activation rows" if rc == -1
                          else "this build of quant_linear.c has no packed int8 GEMM (neither VNNI nor AVX2)")
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


__all__ = ["ACT_BLOCK", "GEMV_MAX_ROWS", "QMAX", "SCHEMES", "a8_ok", "dequantize", "dequantize_into", "gemm_int8_vnni",
           "gather_columns", "gemv", "pack_int8_vnni", "pack_int8_vnni_reference", "unpack_int8_vnni", "vnni_available",
           "gemv_a8_reference", "gemv_function", "kernel_ok", "pack_int4", "panels_kernel", "quantize",
           "quantize_activations", "unpack_int4", "zero_point_correction", "zero_point_correction_into"]
