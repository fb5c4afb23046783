"""The network's linear layers on CPU (float32): one packed C GEMM for every row count, oneDNN where it cannot run.

Why not `F.linear`: PyTorch's CPU `F.linear` calls MKL, whose fp32 GEMM for LLM shapes is slow on
AMD processors and barely uses a second thread (2-core AMD EPYC, [16 x 896] x [896 x 9728]:
14.2 ms vs 6.1 ms through oneDNN), and neither MKL nor oneDNN streams the weights once for the
2-64 rows of a batched decode step: their kernels for a handful of rows re-read them.

Why packed weights (`linear.c`): at engine load (`CpuLinear.pack_weights`, called by the loader)
each weight [N, K] is rewritten once into panels of 16 output features, k-major
(`pack_reference` is the layout in torch); the kernel's register tiles (8 rows x 32 features on
AVX-512, 6 x 16 on AVX2) then read each weight vector once per tile and reuse it for every row of
the tile, so a decode step streams the weights once and the FMAs of a tile never wait on each
other; more rows are blocked like any GEMM, in (rows x columns) work units that keep their partial
sums in L2 and go to whichever thread is free (linear.c's header, with the measurements). Measured
on a 2-vCPU Intel Xeon (AVX-512) shared with other work, 2 threads, scripts/bench_linear.py: the
linears of a decode step of 1-8 rows run 1.1-3.7x oneDNN's speed (memory-bound: the weights stream
once), 16-128 rows 1.0-2.1x, 256-2048 rows about even with oneDNN (0.94-1.15x; gate+up, 896 x 9728,
2048 rows: 184 GFLOP/s, oneDNN 160, the previous loop order 137). Whole decode steps:
docs/benchmarks.md ("Batched decode"), from scripts/profile_decode.py.

Packing copies the weights once, into anonymous memory instead of the page cache's mapping of the
engine file: ~0.8 s per GB on 2 shared cores, mostly the first touch of the new pages (advising
them to transparent huge pages measured slower there: 2.3 vs 1.6 s for a 2 GB model). A tied LM head
packs the embedding table and the embeddings are then looked up from the packed copy
(`PackedEmbedding`), so no table is held twice.

Which layers use it: the kernels registry (plugins/kernels.py) chooses "cpu" linears for float32
on CPU where this torch has oneDNN's linear (`onednn_available`), unless `TRTFORGE_CPU_ONEDNN=0`
(plain `F.linear`); the network is then built with a `CpuLinear` for every linear layer and a
`TiedLMHead` on `cpu_linear` (models/layers.py). Where the C library cannot be built
(`TRTFORGE_CPU_NATIVE=0`, no compiler) nothing is packed and every product runs oneDNN on the
dense weight. Under autograd, tracing or export a packed layer runs `F.linear` on its unpacked
weight. All give the same results up to float32 summation order.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import nn

from trtforge.plugins import native

PANEL = 16
"""Output features per packed panel (linear.c)."""
PAIR = 32
"""The packed layout pads N to a multiple of this (two panels: an AVX-512 tile's width)."""

_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {"trtforge_packed_linear": (None, [_P, _I, _P, _P, _P, _I, _I, _I]),
               "trtforge_pack_linear": (None, [_P, _I, _I, _P, _I]),
               "trtforge_packed_rows": (ctypes.c_int, [_P, _I, _I, _P, _I, _P])}
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


def packed_shape(out_features: int, in_features: int) -> tuple[int, int, int]:
    """The packed layout's shape: [panels, K, PANEL], N padded to a multiple of PAIR."""
    return -(-out_features // PAIR) * (PAIR // PANEL), in_features, PANEL


def pack_reference(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] in the packed layout, by torch: P[p, i, j] = W[16 p + j, i], zero rows past N."""
    n, k = weight.shape
    panels = packed_shape(n, k)[0]
    padded = torch.nn.functional.pad(weight, (0, 0, 0, panels * PANEL - n))
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def unpack(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The dense W [N, K] of a packed weight (a copy)."""
    panels, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(panels * PANEL, k)[:out_features].contiguous()


def pack(weight: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """W [N, K] float32 in the packed layout, by the C kernel of `lib` (default this process's)."""
    lib = lib or library()
    n, k = weight.shape
    if lib is None or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return pack_reference(weight)
    weight = weight.contiguous()
    out = torch.empty(packed_shape(n, k))
    lib.trtforge_pack_linear(weight.data_ptr(), n, k, out.data_ptr(), torch.get_num_threads())
    return out


def packed_ok(x: torch.Tensor) -> bool:
    """Whether the packed kernel may take x: `native_ok` but for its K % 8 rule (this kernel takes any K)."""
    return (type(x) is torch.Tensor and x.dtype is torch.float32 and x.is_cpu and not torch.is_grad_enabled()
            and x.is_contiguous() and not torch._C._get_tracing_state() and not torch.compiler.is_compiling()
            and library() is not None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                  lib: ctypes.CDLL | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b by the packed C kernel; x float32 contiguous CPU [..., K] (`packed_ok`). out: a
    contiguous float32 tensor of y's shape to write y into (a reused buffer, plugins/cpu/workspace.py)."""
    lib = lib or LIBRARY.lib
    k = packed.shape[1]
    rows = x.numel() // k
    y = x.new_empty((*x.shape[:-1], out_features)) if out is None else out
    lib.trtforge_packed_linear(x.data_ptr(), rows, packed.data_ptr(), None if bias is None else bias.data_ptr(),  # type: ignore[union-attr]
                               y.data_ptr(), out_features, k, torch.get_num_threads())
    return y


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x W^T + b on a dense W [out, in], float32 on CPU: oneDNN (contiguous x). The layers that
    pack their weights (CpuLinear, TiedLMHead) run `packed_linear` instead."""
    if not x.is_contiguous():
        x = x.contiguous()
    return onednn_linear(x, weight, bias)


class CpuLinear(nn.Module):
    """y = x W^T + b, float32 on CPU, through the packed C kernel once `pack_weights` has run (the
    loader calls it), oneDNN on the dense weight before or without it. Buffers `weight` (dense
    [out, in]: the state-dict name of nn.Linear, None once packed), `packed`, `bias`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.detach().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().contiguous())
        self.register_buffer("packed", None, persistent=False)
        self.register_load_state_dict_post_hook(_keep_contiguous)

    @classmethod
    def empty(cls, in_features: int, out_features: int, bias: bool) -> "CpuLinear":
        """Uninitialised, for a network whose weights are loaded afterwards (on meta: no storage)."""
        return cls(torch.empty(out_features, in_features), torch.empty(out_features) if bias else None)

    def pack_weights(self) -> None:
        """Pack the weight for the C kernel and drop the dense copy (no-op without the library)."""
        if self.packed is None and self.weight is not None and library() is not None and not self.weight.is_meta:
            self.packed, self.weight = pack(self.weight), None

    def dense_weight(self) -> torch.Tensor:
        """W [out, in]: the dense buffer, or unpacked (a copy) once packed."""
        return self.weight if self.weight is not None else unpack(self.packed, self.out_features)

    def extra_repr(self) -> str:
        layout = "packed" if self.packed is not None else "dense"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{layout}")

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """out: where the packed kernel may write y (contiguous, y's shape); the other paths return a new
        tensor, so a caller always uses the tensor returned."""
        if self.packed is not None:
            if packed_ok(x):
                return packed_linear(x, self.packed, self.bias, self.out_features, out=out)
            return torch.nn.functional.linear(x, self.dense_weight(), self.bias)
        return cpu_linear(x, self.weight, self.bias)


class PackedEmbedding(nn.Module):
    """Token embeddings looked up in a packed tied LM head (`TiedLMHead.packed`): the rows of the
    table it was packed from, so the table itself need not be kept. Holds no tensor of its own."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self._head = (head,)  # a tuple: not a submodule, so the state dict names nothing twice
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, input_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        packed = self._head[0].packed
        ids = input_ids.reshape(-1).to(torch.int64).contiguous()
        if out is None:
            out = torch.empty(ids.numel(), self.embedding_dim)
        if LIBRARY.lib.trtforge_packed_rows(packed.data_ptr(), self.num_embeddings, self.embedding_dim,  # type: ignore[union-attr]
                                            ids.data_ptr(), ids.numel(), out.data_ptr()):
            raise IndexError(f"token id out of range [0, {self.num_embeddings}) in the embedding lookup")
        return out.view(*input_ids.shape, self.embedding_dim)


def _keep_contiguous(module: CpuLinear, _incompatible) -> None:
    """The C kernels read W and b by raw pointer: loaded tensors must be dense (safetensors' are)."""
    for name in ("weight", "bias"):
        t = getattr(module, name)
        if t is not None and not t.is_meta and not t.is_contiguous():
            setattr(module, name, t.contiguous())


__all__ = ["PANEL", "PAIR", "CpuLinear", "PackedEmbedding", "cpu_linear", "onednn_available", "onednn_linear",
           "pack", "pack_reference", "packed_linear", "packed_ok", "packed_shape", "unpack"]
