"""Quantized linear layers at every row count: the int8-activation row kernels (what QuantLinear runs
on CPU for int4, and for int8 without packed panels) against dequantise + oneDNN (the float-activation
path past 32 rows) and oneDNN float32 on the same (dequantised) weights, and for int8 the packed-panel
GEMM that int8 layers run where the build has one (`panels_kernel`: AVX-512 VNNI, or AVX2 on the same
layout; "-" in portable builds).
Shapes: Qwen2.5-0.5B's four decoder linears (qkv, o_proj, gate_up, down), summed; each number the
best of --repeats runs; 2 threads by default. Not run in CI.

    python scripts/bench_quant_gemm.py [--rows 16,32,64,128,512,2048] [--threads 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

import torch

from trtforge.plugins.cpu import quant_linear as ql
from trtforge.plugins.cpu.linear import onednn_linear

SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]  # (out, in): qkv, o_proj, gate_up, down


def best(repeats: int, fn, *args) -> float:
    fn(*args)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t)
    return min(times)


def dequantize_linear(x, scratch, q, s, scheme: str, group: int):
    """The float-activation path: dequantise into `scratch`, then oneDNN."""
    return onednn_linear(x, ql.dequantize_into(scratch, q, s, scheme, group), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="16,32,64,128,512,2048")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if ql.library() is None:
        raise SystemExit("the quantized kernels could not be built here")
    torch.manual_seed(0)
    print(f"{'scheme':8s} {'rows':>5s} {'oneDNN f32 ms':>14s} {'deq+oneDNN ms':>14s} {'int8-act ms':>12s} "
          f"{'GFLOP/s':>8s} {'vs f32':>7s} {'vs deq':>7s} {'packed ms':>10s} {'GFLOP/s':>8s} {'vs a8':>6s}")
    print(f"packed-panel kernel: {ql.panels_kernel() or 'none (portable build)'}")
    for scheme, group in (("int8_wo", 0), ("int4_wo", 128)):
        weights = []
        for n, k in SHAPES:
            q, s = ql.quantize(torch.randn(n, k) * 0.02, scheme, group)
            packed = ql.pack_int8_vnni(q) if scheme == "int8_wo" and ql.panels_kernel() else None
            weights.append((q, s, ql.dequantize(q, s, scheme, group), torch.empty(n, k), packed))
        for rows in map(int, args.rows.split(",")):
            t = {"f32": 0.0, "deq": 0.0, "a8": 0.0, "packed": 0.0}
            with torch.inference_mode():
                for (n, k), (q, s, wd, scratch, packed) in zip(SHAPES, weights):
                    x = torch.randn(rows, k)
                    t["f32"] += best(args.repeats, onednn_linear, x, wd, None)
                    t["deq"] += best(args.repeats, dequantize_linear, x, scratch, q, s, scheme, group)
                    t["a8"] += best(args.repeats, ql.gemv, x, q, s, None, scheme, group, "int8")
                    if packed is not None:
                        t["packed"] += best(args.repeats, ql.gemm_int8_vnni, x, *packed, s, None, n)
            flop = 2 * rows * sum(n * k for n, k in SHAPES)
            print(f"{scheme:8s} {rows:5d} {1e3 * t['f32']:14.1f} {1e3 * t['deq']:14.1f} {1e3 * t['a8']:12.1f} "
                  f"{flop / t['a8'] / 1e9:8.0f} {t['f32'] / t['a8']:6.2f}x {t['deq'] / t['a8']:6.2f}x "
                  + (f"{1e3 * t['packed']:10.1f} {flop / t['packed'] / 1e9:8.0f} {t['a8'] / t['packed']:5.2f}x"
                     if t["packed"] else f"{'-':>10s}"), flush=True)


if __name__ == "__main__":
    main()
