"""The C decode kernel (`cpu_decode.c`) behind the CPU attention path, and when to use it.

`cpu.paged_attention` calls `decode` for a pure-decode step in float32 on CPU (float32 or int8 KV
pool; with int8 the kernel quantises the new rows and dequantises cached ones in registers). The kernel does
the KV write and the attention of every sequence in one call, its (sequence, KV head) pairs split
over torch's OpenMP threads: for a batch-1 step that replaces ~20 ATen ops per layer (index_copy_,
index_select gathers, transposes, SDPA) with one ~2 µs ctypes call plus the arithmetic, and for big
batches it saves the gathers. Measured on the 2-core AMD EPYC (Zen 3), Qwen2.5-0.5B's heads, this
kernel vs the gather + SDPA path (both 2 threads), ms: 8 seqs x 512 ctx 0.58 vs 0.76; 32 x 512
2.32 vs 3.74; 56 x 600 4.91 vs 7.53; 64 x 1024 15.8 vs 18.1; 4 x 4096 3.04 vs 3.28; 1 x 8192 2.16
vs 2.15. (When it ran single-threaded, SDPA won past ~4096 tokens of context in the batch: hence
`MAX_CONTEXT_TOKENS`, now only a bound on the score buffers.) Its second version (16 positions per
step, 16-wide AVX-512 vectors, longest pairs first: cpu_decode.c) halved that kernel's time on the
2-vCPU Xeon of docs/benchmarks.md: 64 x 256, every layer's pool read from memory, 1.57 vs 3.04 ms
a layer (`scripts/bench_attention_cpu.py --compare-source`).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from trtforge.plugins import native

MAX_CONTEXT_TOKENS = 1 << 20
"""Largest sum of context lengths in a decode batch that the kernel takes (the torch path beyond)."""

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {"trtforge_decode_attention": (ctypes.c_int, [_P, _I, _P, _I, _P, _I, _P, _I, _I, _P, _P, _I,
                                                            _P, _P, _I, _I, _I, _I, _F, _F, _I, _I]),
               "trtforge_decode_attention_int8": (ctypes.c_int, [_P, _I, _P, _I, _P, _I, _P, _P, _I, _I, _P, _P,
                                                                 _I, _P, _P, _I, _I, _I, _I, _F, _F, _I, _I])}
LIBRARY = native.NativeLibrary(Path(__file__).with_name("cpu_decode.c"), _SIGNATURES,
                               extra_flags=("-fopenmp", "-ffp-contract=fast"))
library = LIBRARY.get  # the compiled kernel, or None where it cannot be built (torch path)


def _rows_dense(t: torch.Tensor) -> bool:
    """[T, H, D] with each token's heads contiguous (token stride free: views of a fused qkv)."""
    return t.stride(2) == 1 and t.stride(1) == t.shape[2]


def applies(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, lens: list[int],
            kv_scales: torch.Tensor | None = None) -> bool:
    """Whether `decode` can take this pure-decode call (dtypes, layouts, size) — else the torch path.
    int8 KV (kv_scales given): kv_cache int8, kv_scales float32 and contiguous."""
    f32 = torch.float32
    pool_ok = (kv_cache.dtype is f32 if kv_scales is None else
               kv_cache.dtype is torch.int8 and kv_scales.dtype is f32 and kv_scales.is_contiguous())
    return (q.dtype is f32 and pool_ok and k.dtype is f32 and v.dtype is f32
            and q.is_cpu and q.shape[2] % 8 == 0 and slot_mapping.dtype is torch.int64
            and block_tables.dtype is torch.int32 and seq_lens.dtype is torch.int32
            and sum(lens) <= MAX_CONTEXT_TOKENS and library() is not None
            and _rows_dense(q) and _rows_dense(k) and _rows_dense(v) and kv_cache.is_contiguous()
            and block_tables.is_contiguous() and seq_lens.is_contiguous() and slot_mapping.is_contiguous())


def decode(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, scale: float,
           kv_scales: torch.Tensor | None = None, softcap: float = 0.0, window: int = 0) -> torch.Tensor:
    """KV write + attention for T = S sequences of one new token each: q [S, Hq, D] -> [S, Hq, D].
    kv_scales: the int8 pool's scales (then the int8 kernel, which quantises the new rows).
    softcap: > 0 caps the scaled scores at ±softcap (softcap * tanh(s / softcap)); 0: none.
    window: > 0 each token sees only the last `window` positions (reference.py); 0: all."""
    num_seqs, num_heads, head_dim = q.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    out = torch.empty_like(q)
    lib = LIBRARY.get()  # loaded by applies() in the op; a direct caller may come first
    pool = ((lib.trtforge_decode_attention, kv_cache.data_ptr()) if kv_scales is None else  # type: ignore[union-attr]
            (lib.trtforge_decode_attention_int8, kv_cache.data_ptr(), kv_scales.data_ptr()))  # type: ignore[union-attr]
    status = pool[0](  # (applies() loaded the library)
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
        *pool[1:], num_blocks, block_size,
        slot_mapping.data_ptr(), block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr(),
        out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, scale, softcap, int(window),
        torch.get_num_threads())
    if status != 0:
        raise ValueError(f"decode attention: a block id, slot or sequence length is out of range "
                         f"(seq_lens={seq_lens.tolist()}, slot_mapping={slot_mapping.tolist()}, "
                         f"{num_blocks} blocks of {block_size}, block table width {block_tables.shape[1]})")
    return out
