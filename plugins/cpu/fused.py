"""Fused float32 CPU kernels for the network's per-token ops, each beside its torch reference.

Why: a batch-1 decode step of a 0.5B model on CPU spends ~20 % of its time outside the matrix
products, in ~1,000 tiny ATen ops (an RMSNorm alone is ~8 ops, RoPE 7, SiLU·mul 3) whose dispatch
costs more than their arithmetic. `fused.c` does each group in one loop: add + RMSNorm, RoPE in
place, SiLU·mul — 16 floats a step on AVX-512, and split by rows over the OpenMP threads for
batches of at least 32K values (a big decode step; a batch-1 step stays on the calling thread).
A network built with fused ops (the kernels registry's `fused_ops` row,
plugins/kernels.py: float32 on CPU) tries the functions here first: they run the C kernel for
float32 CPU tensors in plain eager inference (no autograd, tracing, export or fake tensors) and
return None / False otherwise, or where the kernels cannot be built (plugins/native.py;
`TRTFORGE_CPU_NATIVE=0` turns them off), and the network then runs its own torch code — the
references, beside them in models/network.py and models/rope.py. Both agree up to float32 rounding
(tests/plugins/cpu/test_fused.py).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from trtforge.plugins import native

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {"trtforge_rms_norm": (None, [_P, _P, _P, _P, _I, _I, _F]),
               "trtforge_silu_mul": (None, [_P, _P, _I, _I]),
               "trtforge_rope": (None, [_P, _P, _P, _I, _I, _I, _I]),
               # Mixture-of-Experts decode (the CPU decode plan's MoE layers; references in models/moe.py)
               "trtforge_head_rms_norm": (None, [_P, _P, _I, _I, _I, _I, _F]),
               "trtforge_moe_route": (None, [_P, _I, _I, _I, _I, _P, _P, _P, _P, _P]),
               "trtforge_gather_rows": (None, [_P, _P, _I, _I, _P]),
               "trtforge_moe_combine": (None, [_P, _P, _P, _I, _I, _I, _P, _P, _P])}
LIBRARY = native.NativeLibrary(Path(__file__).with_name("fused.c"), _SIGNATURES, extra_flags=("-fopenmp",))
"""-fopenmp: a big batch's rows go over torch's OpenMP threads (the same libgomp, so its thread count)."""
library = LIBRARY.get  # the library, or None where it cannot be built (then the torch path runs)


def native_ok(x: torch.Tensor) -> bool:
    """Whether the C kernels may take x: a plain float32 CPU tensor, contiguous, last dim a multiple
    of 8, in eager inference (no autograd, jit tracing or compiling; fake and functional tensors
    of export/compile are subclasses, hence `type(x) is torch.Tensor`), kernels built.
    Cheapest tests first: this runs ~100 times per decode step."""
    return (type(x) is torch.Tensor and x.dtype is torch.float32 and x.is_cpu
            and not torch.is_grad_enabled() and x.shape[-1] % 8 == 0 and x.is_contiguous()
            and not torch._C._get_tracing_state() and not torch.compiler.is_compiling()
            and library() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rms_norm(x + residual) * weight, x + residual), the sum written into `residual` in place;
    without a residual (rms_norm(x) * weight, x). None where the kernel cannot run."""
    if not (native_ok(x) and weight.is_contiguous() and (residual is None or residual.is_contiguous())):
        return None
    out = torch.empty_like(x)
    LIBRARY.lib.trtforge_rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(),  # type: ignore[union-attr]
                               weight.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps)
    return out, x if residual is None else residual


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """gate_up [T, 2I] (gate, then up) -> silu(gate) * up [T, I]; None where the kernel cannot run.
    out: a contiguous float32 [T, I] to write it into (a reused buffer, plugins/cpu/workspace.py)."""
    inter = gate_up.shape[-1] // 2
    if not (native_ok(gate_up) and inter % 8 == 0):
        return None
    if out is None:
        out = gate_up.new_empty((*gate_up.shape[:-1], inter))
    LIBRARY.lib.trtforge_silu_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * inter), inter)  # type: ignore[union-attr]
    return out


def rope_heads_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> bool:
    """Rotate the first `heads` heads of qkv [T, H, D] in place (cos/sin [T, 1, D], as
    rope.rotary_cos_sin makes them); False, touching nothing, where the kernel cannot run."""
    if not (native_ok(qkv) and cos.dtype is torch.float32 and sin.dtype is torch.float32
            and cos.is_contiguous() and sin.is_contiguous()):
        return False
    tokens, num_heads, head_dim = qkv.shape
    LIBRARY.lib.trtforge_rope(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), tokens, heads,  # type: ignore[union-attr]
                           num_heads * head_dim, head_dim)
    return True


def moe_route(logits: torch.Tensor, k: int, normalize: bool) -> dict[str, torch.Tensor]:
    """The C router (`trtforge_moe_route`) on float32 logits [T, E]: {"weights" [T, k], "ids" [T, k] (as
    models/moe.py `route`), "counts" [E], "position" [T·k] (each (token, slot) pair's place in expert order),
    "sorted_token" [T·k] (the token at each place)}. The CPU decode plan calls the kernel on its own buffers;
    this wrapper is for tests. Raises RuntimeError where the kernels cannot be built."""
    lib = library()
    if lib is None:
        raise RuntimeError("the fused C kernels are not available (plugins/native.py)")
    logits = logits.float().contiguous()
    t, e = logits.shape
    out = {"weights": torch.empty(t, k), "ids": torch.empty(t, k, dtype=torch.int64),
           "counts": torch.empty(e, dtype=torch.int64), "position": torch.empty(t * k, dtype=torch.int64),
           "sorted_token": torch.empty(t * k, dtype=torch.int64)}
    lib.trtforge_moe_route(logits.data_ptr(), t, e, k, int(normalize), *(v.data_ptr() for v in out.values()))
    return out
