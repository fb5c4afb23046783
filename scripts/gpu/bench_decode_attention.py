"""Decode-attention bandwidth of the Triton paged-attention kernels vs the device's copy bandwidth.

Decode attention reads every cached K/V byte once per step, so its speed limit is memory
bandwidth. For each context length the batch is the smallest power of two whose KV read is at
least --min-kv-gib, blocks are scattered randomly in the pool (as after hours of serving), and

    achieved GB/s = (KV bytes read + q, out, new k/v bytes) / kernel time
    copy GB/s     = 2 * bytes / time of one big device-to-device copy (read + write)

Reports the default configuration (automatic KV splits) and a small sweep (splits, tile, warps),
so defaults can be re-tuned from one run. Writes decode_attention_bandwidth.json and .txt.

    python scripts/gpu/bench_decode_attention.py --out OUT_DIR            # on the GPU
    python scripts/gpu/bench_decode_attention.py --out /tmp/x --dry-run   # CPU, interpreter, tiny
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from gpu_common import wall_timer, write_json

TARGET_FRACTION = 0.70
SWEEP = [  # (num_kv_splits, tile_n, num_warps); None = the kernels' automatic choice
    (None, None, 4), (1, 32, 4), (4, 32, 4), (8, 32, 4), (16, 32, 4), (32, 32, 4),
    (None, 64, 4), (None, 64, 8), (16, 64, 8),
]


def copy_bandwidth(device: str, nbytes: int, iters: int) -> float:
    """GB/s of a device-to-device copy (bytes read + bytes written)."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    with wall_timer(device) as t:
        for _ in range(iters):
            dst.copy_(src)
    return 2 * nbytes * iters / t["s"] / 1e9


def decode_case(batch: int, context: int, args, device: str) -> dict:
    """One decode step of `batch` sequences with `context - 1` cached tokens each."""
    dtype = getattr(torch, args.dtype)
    bs, hkv, d = args.block_size, args.kv_heads, args.head_dim
    blocks_per_seq = math.ceil(context / bs)
    num_blocks = batch * blocks_per_seq
    gen = torch.Generator(device="cpu").manual_seed(0)
    tables = torch.randperm(num_blocks, generator=gen).view(batch, blocks_per_seq).to(torch.int32)
    pos = context - 1
    slots = tables[:, pos // bs].long() * bs + pos % bs
    return dict(
        q=torch.randn(batch, args.heads, d, dtype=dtype, device=device),
        k=torch.randn(batch, hkv, d, dtype=dtype, device=device),
        v=torch.randn(batch, hkv, d, dtype=dtype, device=device),
        kv_cache=torch.randn(2, num_blocks, bs, hkv, d, dtype=dtype, device=device),
        slot_mapping=slots.to(device), block_tables=tables.to(device),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
    )


def bytes_moved(case: dict, context: int) -> int:
    """KV context read + q read + out written + new k/v written (block tables are noise)."""
    kv = case["kv_cache"]
    batch, per_token = case["q"].shape[0], 2 * kv.shape[3] * kv.shape[4] * kv.element_size()
    small = 2 * case["q"].numel() * case["q"].element_size() + batch * per_token
    return batch * context * per_token + small


def check_correct(case: dict, out: torch.Tensor) -> float:
    """Max abs difference from the op's torch implementation (same inputs, its own pool copy)."""
    from trtforge.plugins.paged_attention import cpu

    c = {k: v.clone() for k, v in case.items()}
    expected = cpu.paged_attention(c["q"], c["k"], c["v"], c["kv_cache"], c["slot_mapping"],
                                   c["block_tables"], c["seq_lens"], c["query_start_loc"],
                                   c["q"].shape[-1] ** -0.5)
    return (out.float() - expected.float()).abs().max().item()


def measure(case: dict, context: int, config: tuple, device: str, iters: int) -> tuple:
    """(seconds per call, output) of paged_attention_triton under one sweep config."""
    from trtforge.plugins.paged_attention.triton_kernels import paged_attention_triton

    splits, tile_n, warps = config
    c = case

    def call():
        return paged_attention_triton(
            c["q"], c["k"], c["v"], c["kv_cache"], c["slot_mapping"], c["block_tables"],
            c["seq_lens"], c["query_start_loc"], c["q"].shape[-1] ** -0.5, 1, context,
            num_kv_splits=splits, tile_n=tile_n, num_warps=warps)

    out = call()  # compile + warm up
    with wall_timer(device) as t:
        for _ in range(iters):
            call()
    return t["s"] / iters, out


def run(args) -> dict:
    device = "cpu" if args.dry_run else "cuda"
    kv_per_token = 2 * args.kv_heads * args.head_dim * torch.tensor([], dtype=getattr(
        torch, args.dtype)).element_size()
    copy_gbs = copy_bandwidth(device, args.copy_bytes, args.iters)
    rows = []
    for context in args.contexts:
        batch = 2 ** math.ceil(math.log2(max(1, args.min_kv_gib * 2**30 / (context * kv_per_token))))
        case = decode_case(batch, context, args, device)
        nbytes = bytes_moved(case, context)
        configs = SWEEP[:2] if args.dry_run else SWEEP
        for config in configs:
            seconds, out = measure(case, context, config, device, args.iters)
            gbs = nbytes / seconds / 1e9
            row = dict(context=context, batch=batch, kv_gib=batch * context * kv_per_token / 2**30,
                       num_kv_splits=config[0] or "auto", tile_n=config[1] or "auto",
                       num_warps=config[2], us=seconds * 1e6, gb_s=gbs, fraction_of_copy=gbs / copy_gbs)
            if config == SWEEP[0]:
                row["max_abs_err_vs_torch"] = check_correct(case, out)
            rows.append(row)
            print(_fmt(row), flush=True)
        del case
        if device == "cuda":
            torch.cuda.empty_cache()
    default_rows = [r for r in rows if r["num_kv_splits"] == "auto" and r["tile_n"] == "auto"]
    return dict(copy_gb_s=copy_gbs, target_fraction=TARGET_FRACTION,
                shape=dict(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                           block_size=args.block_size, dtype=args.dtype),
                meets_target=all(r["fraction_of_copy"] >= TARGET_FRACTION for r in default_rows),
                best_per_context={c: max((r for r in rows if r["context"] == c),
                                         key=lambda r: r["gb_s"]) for c in args.contexts},
                rows=rows, dry_run=args.dry_run)


def _fmt(r: dict) -> str:
    return (f"ctx={r['context']:6d} batch={r['batch']:4d} kv={r['kv_gib']:6.2f}GiB "
            f"splits={r['num_kv_splits']!s:>4} tile={r['tile_n']!s:>4} warps={r['num_warps']} "
            f"{r['us']:10.1f}us {r['gb_s']:8.1f}GB/s {100 * r['fraction_of_copy']:5.1f}% of copy")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="directory for the JSON/text report")
    p.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")],
                   default=[4096, 16384, 32768])
    p.add_argument("--min-kv-gib", type=float, default=2.0, help="KV bytes read per call, at least")
    # Llama-3-8B's attention shape: 32 query heads over 8 KV heads of 128 (G = 4).
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--copy-bytes", type=int, default=4 * 2**30)
    p.add_argument("--dry-run", action="store_true",
                   help="CPU + Triton interpreter, tiny shapes: checks the script, not the speed")
    args = p.parse_args(argv)
    if args.dry_run:
        args.contexts, args.min_kv_gib, args.iters = [40, 100], 1e-5, 1
        args.heads, args.kv_heads, args.head_dim, args.dtype = 4, 2, 16, "float32"
        args.copy_bytes = 2**20
    elif not torch.cuda.is_available():
        p.error("needs a CUDA GPU (use --dry-run to check the script on CPU)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "decode_attention_bandwidth.json", result)
    lines = [f"copy bandwidth: {result['copy_gb_s']:.1f} GB/s; target >= "
             f"{100 * TARGET_FRACTION:.0f}% with the default config: "
             f"{'MET' if result['meets_target'] else 'NOT MET'}"]
    lines += [_fmt(r) for r in result["rows"]]
    (args.out / "decode_attention_bandwidth.txt").write_text("\n".join(lines) + "\n")
    print(lines[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
