"""Time the paged-attention op's CPU path against the reference and a naive per-sequence baseline.

    python scripts/bench_attention_cpu.py [--dtype float32|bfloat16] [--threads N] [--json F]

Shapes are Qwen2.5-0.5B's attention (Hq=14, Hkv=2, D=64), block size 16. "naive" is what a
straightforward torch port would do: per sequence, gather its blocks, repeat KV heads for GQA and
call SDPA with an offset-causal mask. All three run on the same inputs in the same process;
each number is the best of --repeats wall-clock runs (reference: one run), in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from trtforge.plugins.paged_attention import cpu, reference
from trtforge.plugins.paged_attention.testing import make_case

WORKLOADS = {
    "decode 32 seqs x 512 ctx": [(511, 1)] * 32,
    "prefill 512 tokens": [(0, 512)],
    "mixed: 256-token chunk after 256 + 31 decodes x 512": [(256, 256)] + [(511, 1)] * 31,
}


def naive(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale):
    reference.write_kv(kv_cache, k, v, slot_mapping)
    out, group = torch.empty_like(q), q.shape[1] // k.shape[1]
    block_size = kv_cache.shape[2]
    for s, seq_len in enumerate(seq_lens.tolist()):
        a, b = query_start_loc[s].item(), query_start_loc[s + 1].item()
        blocks = block_tables[s, : -(-seq_len // block_size)].long()
        keys = kv_cache[0, blocks].flatten(0, 1)[:seq_len].repeat_interleave(group, 1)
        values = kv_cache[1, blocks].flatten(0, 1)[:seq_len].repeat_interleave(group, 1)
        pos = seq_len - (b - a) + torch.arange(b - a)
        mask = torch.arange(seq_len)[None, :] <= pos[:, None]
        o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), keys.transpose(0, 1),
                                           values.transpose(0, 1), attn_mask=mask, scale=scale)
        out[a:b] = o.transpose(0, 1)
    return out


def best_ms(fn, case, repeats: int, warmup: bool = True) -> float:
    if warmup:
        fn(*case.op_args())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*case.op_args())
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    rows = []
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}")
    print(f"{'workload (ms)':55s} {'reference':>10s} {'naive':>9s} {'cpu':>8s} {'vs ref':>7s} "
          f"{'vs naive':>8s}")
    for name, seqs in WORKLOADS.items():
        case = make_case(seqs, block_size=16, num_heads=14, num_kv_heads=2, head_dim=64,
                         dtype=dtype, spare_blocks=64)
        ms = {"reference": best_ms(reference.paged_attention, case, 1, warmup=False),
              "naive": best_ms(naive, case, args.repeats),
              "cpu": best_ms(cpu.paged_attention, case, args.repeats)}
        rows.append({"workload": name, "dtype": args.dtype, "threads": torch.get_num_threads(),
                     **{f"{k}_ms": v for k, v in ms.items()}})
        print(f"{name:55s} {ms['reference']:10.1f} {ms['naive']:9.2f} {ms['cpu']:8.2f} "
              f"{ms['reference'] / ms['cpu']:6.0f}x {ms['naive'] / ms['cpu']:7.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
