"""`torch.ops.trtforge.paged_attention`: the one attention op of every trtforge network.

The op owns the contract: it writes the new tokens' k/v into the layer's KV pool (declared as a
mutation, so tracing and export see it) and returns causal attention over each sequence's cached +
new context. Per layer and step, for T new tokens packed from S sequences (prefill chunks and
decode tokens mixed):

    q [T, Hq, D], k/v [T, Hkv, D]        the new tokens (GQA from Hq / Hkv)
    kv_cache [2, num_blocks, block_size, Hkv, D]   the layer's pool (K then V; NHD per block)
    slot_mapping int64 [T]               block_id * block_size + offset of each new token
    block_tables int32 [S, max_blocks]   physical block ids of each sequence
    seq_lens int32 [S]                   context length after this step (cached + new)
    query_start_loc int32 [S + 1]        offsets of each sequence's new tokens in the batch
    scale float                          softmax scale
    softcap float = 0.0                  > 0: each scaled score s becomes softcap * tanh(s / softcap)
                                         before the mask and softmax (Gemma 2); 0: none
    window int = 0                       > 0: sliding window, a token at p attends to (p - window, p]
                                         only (transformers' rule); 0: all of 0..p
    -> [T, Hq, D]; a token at absolute position p attends to cache positions 0..p of its sequence
       (window > 0: max(0, p - window + 1)..p; positions before the first one any new token of a
       sequence sees are never read, so their blocks may be freed and their table entries stale).

`softcap` is the last argument of both ops (after kv_scales for int8 KV) and defaults to 0, so a
network without soft-capping calls and traces the op exactly as before. The reference and cpu
implementations (its torch path and the C decode kernel) take it; the Triton kernels, the ONNX
node and the TensorRT plugin do not: `attention_impl(..., softcap=True)` skips Triton for the torch
path ("cpu", also correct on CUDA) unless Triton was requested by name (then it raises), the op
raises if a per-call resolution lands on Triton, and the build refuses --backend tensorrt for a
soft-capped model (builder/build.py).

`window` comes after softcap, also defaulting to 0 (a network without windowed layers calls the op
as before). The reference, the cpu path (torch and the C decode kernel) and the Triton kernels take
it. The ONNX node and TensorRT plugin do not: the tensorrt build keeps max_seq_len capped at the
model's smallest window (builder/build_config.py), where the window never bites, and the exporter
drops the argument (onnx_export.py says so).

int8 KV (`build-engine --kv-cache-dtype int8`): the same contract through the sibling op
`torch.ops.trtforge.paged_attention_int8kv(q, k, v, kv_cache, slot_mapping, block_tables,
seq_lens, query_start_loc, scale, kv_scales)`, where

    kv_cache  int8    [2, num_blocks, block_size, Hkv, D]   quantised K then V
    kv_scales float32 [2, num_blocks, block_size, Hkv]      one scale per stored token and kv head

Writing token t's k (and v) quantises each head row x [D] symmetrically: scale = max|x| / 127,
stored value round(x / scale) in [-127, 127] (so x is recovered as value * scale within scale / 2;
an all-zero row stores scale 0). Attention reads every context position, the new tokens' own
included, as value * scale in float32 (`reference.quantize_kv` / `dequantize_kv`); q, k, v and the
output keep the model dtype. Both pools are mutated; both must be contiguous. It is a separate op so
the float op's schema, ONNX node and TensorRT plugin stay as they are: int8 KV runs on the torch
implementations only ("reference", "cpu" — the torch path also runs on CUDA, and a CUDA engine
with int8 KV is refused by the executor; the Triton kernels do not take it).

Which implementation runs is the kernels registry's choice (plugins/kernels.py: its `attention` row
for the device, TRTFORGE_ATTENTION_IMPL, `kernels.override(attention=...)`):

    auto: CUDA tensors -> "triton" if trtforge.plugins.paged_attention.triton_kernels imports,
          else "cpu" (vectorised torch, also correct on CUDA); CPU tensors -> "cpu".

A runtime network resolves it once, when it is built (`attention_impl`, stored in each Attention
layer); a call through the op (traced and exported graphs, direct calls) resolves it per call
(`resolve_impl`).

Every implementation is a function `(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens,
query_start_loc, scale) -> Tensor` doing both the write and the attention (so a kernel may fuse
them): `reference.paged_attention`, `cpu.paged_attention`, and `_triton_impl`, which adapts
`triton_kernels.paged_attention_triton` (that one also takes max_query_len / max_seq_len hints).
The reference and cpu functions take `kv_scales` as a tenth argument for int8 KV, and `softcap`
after it (keyword `softcap=`).
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import torch
from torch._subclasses.fake_tensor import is_fake

from trtforge.plugins import kernels
from trtforge.plugins.paged_attention import cpu, reference
from trtforge.plugins.paged_attention.metadata import AttentionMetadata

log = logging.getLogger(__name__)

IMPLS = kernels.ATTENTION_IMPLS
ENV_VAR = kernels.ATTENTION_ENV
_TRITON_MODULE = "trtforge.plugins.paged_attention.triton_kernels"

_triton: ModuleType | None | bool = False  # the import, tried once: False = not yet, None = unavailable


def _load_triton(required: bool) -> ModuleType | None:
    """Import the Triton kernels once; absent module or absent `triton` package -> None."""
    global _triton
    if _triton is False:
        try:
            _triton = importlib.import_module(_TRITON_MODULE)
        except ModuleNotFoundError as err:
            if err.name not in (_TRITON_MODULE, "triton") and not (err.name or "").startswith(
                    "triton."):
                raise  # a real bug inside the kernels module: do not hide it
            log.info("Triton attention kernels unavailable (%s); using the torch path", err)
            _triton = None
    if _triton is None and required:
        raise RuntimeError(f"attention implementation 'triton' was requested but {_TRITON_MODULE} "
                           "could not be imported (is the `triton` package installed?); "
                           f"choose another with {ENV_VAR} (or kernels.override(attention=...))")
    return _triton


def _triton_impl(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
                 scale: float, softcap: float = 0.0, window: int = 0) -> torch.Tensor:
    """Triton kernels with their grid-sizing hints derived from shapes alone.

    The kernels are correct for any hints; the hints only pick tile shapes and KV splits. Exact
    maxima would need a device->host sync per layer (or a schema change that would bake the
    values into exported graphs), so we pass sync-free bounds: every scheduled sequence has at
    least one new token, hence max_query_len <= T - S + 1 (exactly 1 for a pure decode step), and
    max_seq_len <= block-table width * block_size.
    """
    if softcap:
        raise _no_softcap("triton")
    num_tokens, num_seqs = q.shape[0], seq_lens.shape[0]
    max_query_len = max(1, num_tokens - num_seqs + 1)
    max_seq_len = block_tables.shape[1] * kv_cache.shape[2]
    return _load_triton(required=True).paged_attention_triton(
        q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale,
        max_query_len, max_seq_len, window=window)


@dataclass(frozen=True)
class AttentionImpl:
    """One resolved implementation: its functions for a float KV pool and for an int8 one."""

    name: str
    float_kv: Callable[..., torch.Tensor]
    int8_kv: Callable[..., torch.Tensor] | None
    """None: this implementation does not take an int8 KV cache (Triton, requested by name)."""

    def function(self, int8_kv: bool = False) -> Callable[..., torch.Tensor]:
        if not int8_kv:
            return self.float_kv
        if self.int8_kv is None:
            raise _no_int8_kv(self.name)
        return self.int8_kv


def _no_softcap(name: str) -> RuntimeError:
    return RuntimeError(f"attention implementation {name!r} has no score soft-capping (attn_logit_softcapping, "
                        f"Gemma 2); use 'auto', 'cpu' or 'reference' ({ENV_VAR} or kernels.override(attention=...))")


def _no_int8_kv(name: str) -> RuntimeError:
    return RuntimeError(f"attention implementation {name!r} does not take an int8 KV cache; use 'auto', "
                        f"'cpu' or 'reference' ({ENV_VAR} or kernels.override(attention=...))")


_TORCH_IMPLS = {"reference": reference.paged_attention, "cpu": cpu.paged_attention}


def attention_impl(preference: tuple[str, ...], device: torch.device, softcap: bool = False) -> AttentionImpl:
    """The first implementation of `preference` (kernels.attention_preference) available for tensors
    on `device`. A single name is a request: Triton then raises where it cannot be imported. int8 KV
    takes the torch path where the float one is Triton's, unless Triton was requested by name.
    softcap: the network soft-caps its attention scores, which Triton does not: the next
    implementation of the preference instead ("cpu"), or an error if Triton was requested by name."""
    name = preference[0]
    if name == "triton":
        if softcap:
            if len(preference) == 1:
                raise _no_softcap("triton")
            return attention_impl(preference[1:], device, softcap)
        if len(preference) == 1:
            _load_triton(required=True)
            return AttentionImpl("triton", _triton_impl, None)
        if device.type == "cuda" and _load_triton(required=False) is not None:
            return AttentionImpl("triton", _triton_impl, cpu.paged_attention)
        return attention_impl(preference[1:], device)
    fn = _TORCH_IMPLS[name]
    return AttentionImpl(name, fn, fn)


def resolve_impl(device: torch.device, int8_kv: bool = False, softcap: bool = False) -> Callable[..., torch.Tensor]:
    """The implementation function the registry chooses now for tensors on `device` (int8_kv: for
    paged_attention_int8kv, whose "auto" is the torch path everywhere; softcap: one that soft-caps)."""
    preference = kernels.attention_preference(device.type)
    if int8_kv and preference == ("triton",):
        raise _no_int8_kv("triton")  # before importing Triton: the answer is no either way
    return attention_impl(preference, device, softcap).function(int8_kv)


def eager_impl(q: torch.Tensor, int8_kv: bool = False,
               chosen: AttentionImpl | None = None) -> Callable[..., torch.Tensor]:
    """What a network should call for this layer: in plain eager execution the implementation
    function itself (`chosen`, the one the network was built with; None: `resolve_impl`'s) — the
    custom-op dispatcher costs ~175 µs a call on CPU, 4 % of a 0.5B decode step; while tracing,
    exporting, or when `torch.ops.trtforge.paged_attention` has been swapped
    (plugins/paged_attention/onnx_export.redirect_paged_attention), the op as it stands.
    int8_kv: the same for `paged_attention_int8kv` (called with kv_scales as its last argument)."""
    op = torch.ops.trtforge.paged_attention_int8kv if int8_kv else torch.ops.trtforge.paged_attention
    if (not isinstance(op, torch._ops.OpOverloadPacket) or torch.compiler.is_compiling()
            or torch.compiler.is_exporting() or is_fake(q) or torch.is_grad_enabled()):
        return op
    if chosen is not None:
        return chosen.function(int8_kv)
    return resolve_impl(q.device, int8_kv)


def check_scales(kv_cache, kv_scales):
    """The int8 KV pool and its scales pool (shapes and dtypes only)."""
    if kv_cache.dtype != torch.int8:
        raise ValueError(f"paged_attention_int8kv needs an int8 kv_cache, got {kv_cache.dtype}")
    if kv_scales.dtype != torch.float32 or list(kv_scales.shape) != list(kv_cache.shape[:4]):
        raise ValueError(f"kv_scales must be float32 [2, num_blocks, block_size, Hkv] = "
                         f"{list(kv_cache.shape[:4])}, got {kv_scales.dtype} {list(kv_scales.shape)}")
    if not kv_scales.is_contiguous():
        raise ValueError("kv_scales must be contiguous (indexed by flat slot like kv_cache)")


def check_inputs(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc):
    """Shape/dtype checks (no data-dependent ones, so they also run on fake tensors)."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, Hkv, D], got "
                         f"{list(kv_cache.shape)}")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous (the op indexes it by flat slot); "
                         "allocate the pool with torch.empty/zeros, not a slice or transpose")
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % num_kv_heads:
        raise ValueError(f"q must be [T, Hq, {head_dim}] with Hq a multiple of Hkv="
                         f"{num_kv_heads}, got {list(q.shape)}")
    num_tokens = q.shape[0]
    for name, t in (("k", k), ("v", v)):
        if list(t.shape) != [num_tokens, num_kv_heads, head_dim]:
            raise ValueError(f"{name} must be [T={num_tokens}, Hkv={num_kv_heads}, "
                             f"D={head_dim}] like q and kv_cache, got {list(t.shape)}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [T={num_tokens}], got {list(slot_mapping.shape)}")
    num_seqs = seq_lens.shape[0]
    if seq_lens.dim() != 1 or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"seq_lens must be [S] and query_start_loc [S+1]; got "
                         f"{list(seq_lens.shape)} and {list(query_start_loc.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [S={num_seqs}, max_blocks_per_seq], got "
                         f"{list(block_tables.shape)}")
    for name, t in (("slot_mapping", slot_mapping), ("block_tables", block_tables),
                    ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if t.is_floating_point() or t.is_complex():
            raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")


@torch.library.custom_op("trtforge::paged_attention", mutates_args=("kv_cache",))
def paged_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                       scale: float, softcap: float = 0.0, window: int = 0) -> torch.Tensor:
    """Write k/v into kv_cache at slot_mapping, return paged causal attention [T, Hq, D]."""
    check_inputs(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc)
    extra = {"window": window} if window else {}
    if not softcap:  # the call every network without soft-capping makes, as before the argument existed
        impl = resolve_impl(q.device)
        return impl(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale, **extra)
    impl = resolve_impl(q.device, softcap=True)
    return impl(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale, softcap=softcap,
                **extra)


@paged_attention_op.register_fake
def _(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale, softcap=0.0, window=0):
    check_inputs(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc)
    return q.new_empty(q.shape)


@torch.library.custom_op("trtforge::paged_attention_int8kv", mutates_args=("kv_cache", "kv_scales"))
def paged_attention_int8kv_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                              slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                              seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                              scale: float, kv_scales: torch.Tensor, softcap: float = 0.0,
                              window: int = 0) -> torch.Tensor:
    """paged_attention over an int8 kv_cache with per-token, per-head float32 kv_scales (module docstring)."""
    check_inputs(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc)
    check_scales(kv_cache, kv_scales)
    impl = resolve_impl(q.device, int8_kv=True, softcap=bool(softcap))
    return impl(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale, kv_scales,
                softcap=softcap, window=window)


@paged_attention_int8kv_op.register_fake
def _(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale, kv_scales, softcap=0.0,
      window=0):
    check_inputs(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc)
    check_scales(kv_cache, kv_scales)
    return q.new_empty(q.shape)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, kv_scales: torch.Tensor | None = None,
                    softcap: float = 0.0, window: int = 0) -> torch.Tensor:
    """Model-side entry point: the op with its metadata taken from an AttentionMetadata
    (kv_scales given: the int8 KV op; softcap > 0: soft-capped scores; window > 0: sliding window)."""
    args = (q, k, v, kv_cache, meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale)
    extra: dict = {"softcap": softcap} if softcap else {}
    if window:
        extra["window"] = window
    if kv_scales is not None:
        return torch.ops.trtforge.paged_attention_int8kv(*args, kv_scales, **extra)
    return torch.ops.trtforge.paged_attention(*args, **extra)
