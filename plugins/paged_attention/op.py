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
    -> [T, Hq, D]; a token at absolute position p attends to cache positions 0..p of its sequence.

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

Which implementation runs is a runtime choice:

    set_attention_impl(name)  >  env TRTFORGE_ATTENTION_IMPL  >  "auto"
    auto: CUDA tensors -> "triton" if trtforge.plugins.paged_attention.triton_kernels imports,
          else "cpu" (vectorised torch, also correct on CUDA); CPU tensors -> "cpu".

Every implementation is a function `(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens,
query_start_loc, scale) -> Tensor` doing both the write and the attention (so a kernel may fuse
them): `reference.paged_attention`, `cpu.paged_attention`, and `_triton_impl`, which adapts
`triton_kernels.paged_attention_triton` (that one also takes max_query_len / max_seq_len hints).
The reference and cpu functions take `kv_scales` as a tenth argument for int8 KV.
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType
from typing import Callable

import torch
from torch._subclasses.fake_tensor import is_fake

from trtforge.plugins.paged_attention import cpu, reference
from trtforge.plugins.paged_attention.metadata import AttentionMetadata

log = logging.getLogger(__name__)

IMPLS = ("auto", "reference", "cpu", "triton")
ENV_VAR = "TRTFORGE_ATTENTION_IMPL"
_TRITON_MODULE = "trtforge.plugins.paged_attention.triton_kernels"

_chosen: str | None = None  # set_attention_impl(); None = follow the environment variable
_triton: ModuleType | None | bool = False  # False = not tried yet, None = unavailable


def set_attention_impl(name: str | None) -> None:
    """Choose the implementation for all later calls; None goes back to the env var / "auto"."""
    if name is not None and name not in IMPLS:
        raise ValueError(f"unknown attention implementation {name!r}; choose one of {IMPLS}")
    global _chosen
    _chosen = name


def get_attention_impl() -> str:
    """The configured implementation name (before "auto" is resolved)."""
    name = _chosen or os.environ.get(ENV_VAR, "auto") or "auto"
    if name not in IMPLS:
        raise ValueError(f"{ENV_VAR}={name!r} is not an attention implementation; "
                         f"set it to one of {IMPLS} or unset it")
    return name


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
                           f"choose another with set_attention_impl() or {ENV_VAR}")
    return _triton


def _triton_impl(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
                 scale: float) -> torch.Tensor:
    """Triton kernels with their grid-sizing hints derived from shapes alone.

    The kernels are correct for any hints; the hints only pick tile shapes and KV splits. Exact
    maxima would need a device->host sync per layer (or a schema change that would bake the
    values into exported graphs), so we pass sync-free bounds: every scheduled sequence has at
    least one new token, hence max_query_len <= T - S + 1 (exactly 1 for a pure decode step), and
    max_seq_len <= block-table width * block_size.
    """
    num_tokens, num_seqs = q.shape[0], seq_lens.shape[0]
    max_query_len = max(1, num_tokens - num_seqs + 1)
    max_seq_len = block_tables.shape[1] * kv_cache.shape[2]
    return _load_triton(required=True).paged_attention_triton(
        q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale,
        max_query_len, max_seq_len)


def resolve_impl(device: torch.device, int8_kv: bool = False) -> Callable[..., torch.Tensor]:
    """The implementation function that will run for tensors on `device` (int8_kv: for
    paged_attention_int8kv, whose "auto" is the torch path everywhere)."""
    name = get_attention_impl()
    if name == "reference":
        return reference.paged_attention
    if name == "cpu" or (int8_kv and name == "auto"):
        return cpu.paged_attention
    if int8_kv:
        raise RuntimeError(f"attention implementation {name!r} does not take an int8 KV cache; "
                           f"use 'auto', 'cpu' or 'reference' (set_attention_impl() or {ENV_VAR})")
    if name == "triton":
        _load_triton(required=True)
        return _triton_impl
    if device.type == "cuda" and _load_triton(required=False) is not None:
        return _triton_impl
    return cpu.paged_attention


def eager_impl(q: torch.Tensor, int8_kv: bool = False) -> Callable[..., torch.Tensor]:
    """What a network should call for this layer: in plain eager execution the implementation
    function itself (the custom-op dispatcher costs ~175 µs a call on CPU, 4 % of a 0.5B decode
    step); while tracing, exporting, or when `torch.ops.trtforge.paged_attention` has been swapped
    (plugins/paged_attention/onnx_export.redirect_paged_attention), the op as it stands.
    int8_kv: the same for `paged_attention_int8kv` (called with kv_scales as its last argument)."""
    op = torch.ops.trtforge.paged_attention_int8kv if int8_kv else torch.ops.trtforge.paged_attention
    if (not isinstance(op, torch._ops.OpOverloadPacket) or torch.compiler.is_compiling()
            or torch.compiler.is_exporting() or is_fake(q) or torch.is_grad_enabled()):
        return op
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
                       scale: float) -> torch.Tensor:
    """Write k/v into kv_cache at slot_mapping, return paged causal attention [T, Hq, D]."""
    check_inputs(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc)
    impl = resolve_impl(q.device)
    return impl(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale)


@paged_attention_op.register_fake
def _(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale):
    check_inputs(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc)
    return q.new_empty(q.shape)


@torch.library.custom_op("trtforge::paged_attention_int8kv", mutates_args=("kv_cache", "kv_scales"))
def paged_attention_int8kv_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                              slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                              seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                              scale: float, kv_scales: torch.Tensor) -> torch.Tensor:
    """paged_attention over an int8 kv_cache with per-token, per-head float32 kv_scales (module docstring)."""
    check_inputs(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc)
    check_scales(kv_cache, kv_scales)
    impl = resolve_impl(q.device, int8_kv=True)
    return impl(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale, kv_scales)


@paged_attention_int8kv_op.register_fake
def _(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale, kv_scales):
    check_inputs(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc)
    check_scales(kv_cache, kv_scales)
    return q.new_empty(q.shape)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Model-side entry point: the op with its metadata taken from an AttentionMetadata
    (kv_scales given: the int8 KV op)."""
    args = (q, k, v, kv_cache, meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale)
    if kv_scales is not None:
        return torch.ops.trtforge.paged_attention_int8kv(*args, kv_scales)
    return torch.ops.trtforge.paged_attention(*args)
