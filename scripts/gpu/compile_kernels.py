"""Compile the Triton paged-attention kernels to sm_90 (H200) cubin on any machine, GPU or not.

Catches what the CPU interpreter cannot: code the compiler rejects (types of loop-carried values,
constexpr specialisation of an argument equal to 1, dot shapes, register/shared-memory blow-ups).
Uses triton's bundled ptxas, so no CUDA toolkit or driver is needed. Prints one line per
variant with registers / shared memory and exits non-zero on the first failure.

    python scripts/gpu/compile_kernels.py [--arch 90]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# Compiled (not interpreted) kernels are what we want to build, even on a machine without CUDA.
os.environ["TRITON_INTERPRET"] = "0"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from trtforge.plugins.paged_attention import triton_kernels as tk

_ATTN_PTRS = ("q_ptr", "cache_ptr", "out_ptr")
_INDEX_PTRS = ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr")


def _signature(fn, constants: dict, pointer_types: dict) -> dict:
    """Every argument: constexpr if given a value, else its pointer type, else i32 (strides)."""
    sig = {}
    for name in fn.arg_names:
        if name in constants:
            sig[name] = "constexpr"
        elif name in pointer_types:
            sig[name] = pointer_types[name]
        else:
            sig[name] = "fp32" if name == "scale_log2" else "i32"
    return sig


def attention_variant(dtype: str, group: int, max_query_len: int, head_dim: int,
                      block_size: int, splits: int, single_seq: bool) -> tuple:
    """(kernel, constants, pointer types) as paged_attention_triton would launch them."""
    block_m, block_q, tile_n = tk._tile_shape(group, max_query_len)
    consts = dict(GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n,
                  BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
                  HEAD_DIM_P=max(16, triton.next_power_of_2(head_dim)), NUM_SPLITS=splits,
                  DOT_PRECISION="ieee" if dtype == "fp32" else None, DOT_FP32=False)
    if single_seq:  # the launcher turns an int argument equal to 1 into a constexpr
        consts["num_seqs"] = 1
    ptrs = {n: f"*{dtype}" for n in _ATTN_PTRS}
    ptrs.update({n: "*i32" for n in _INDEX_PTRS})
    ptrs.update(part_acc_ptr="*fp32", part_m_ptr="*fp32", part_l_ptr="*fp32")
    return tk._attention_kernel, consts, ptrs


def variants() -> list[tuple[str, tuple]]:
    out = [
        ("attention bf16 decode G=4 D=128 bs=16 splits=16",
         attention_variant("bf16", 4, 1, 128, 16, 16, False)),
        ("attention bf16 prefill G=7 D=64 bs=32 one-seq",
         attention_variant("bf16", 7, 512, 64, 32, 1, True)),
        ("attention fp16 mixed G=8 D=80 bs=1", attention_variant("fp16", 8, 64, 80, 1, 1, False)),
        # fp32 prefill tiles (64x64, D=128) also build, but take ~30 s: decode covers ieee dots.
        ("attention fp32 decode G=2 D=128 bs=16 splits=2",
         attention_variant("fp32", 2, 1, 128, 16, 2, False)),
    ]
    write_consts = dict(BLOCK_SIZE=16, HEAD_DIM=128, HEAD_DIM_P=128)
    out.append(("write_kv bf16 D=128", (tk._write_kv_kernel, write_consts, dict(
        k_ptr="*bf16", v_ptr="*bf16", cache_ptr="*bf16", slot_ptr="*i64"))))
    combine_consts = dict(NUM_SPLITS=64, HEAD_DIM=128, HEAD_DIM_P=128)
    out.append(("combine bf16 splits=64 D=128", (tk._combine_splits_kernel, combine_consts, dict(
        part_acc_ptr="*fp32", part_m_ptr="*fp32", part_l_ptr="*fp32", out_ptr="*bf16"))))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10")
    args = parser.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    for name, (fn, consts, ptrs) in variants():
        start = time.perf_counter()
        kernel = triton.compile(ASTSource(fn, _signature(fn, consts, ptrs), consts), target=target)
        print(f"ok  {name:50s} shared={kernel.metadata.shared:6d}B "
              f"{time.perf_counter() - start:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
