"""The packed float32 GEMM (plugins/cpu/linear.c) against oneDNN's linear at every row count, for
Qwen2.5-0.5B's linear shapes: GFLOP/s of each and their ratio. Not a test; not run in CI.

    python scripts/bench_linear.py [--threads 2] [--rows 1,2,4,8,16,32,64,128,256,512,2048]
                                   [--shapes qkv,o,gate_up,down,lm_head] [--repeats 5]
                                   [--baseline path/to/other/linear.c]

Each number is the best of --repeats samples (a sample repeats the call until it has run ~30 ms),
the candidates timed alternately in the same process so a load change hits them alike; the load
average is printed before and after. --baseline also times another build of linear.c (e.g. the
previous commit's, `git show HEAD:plugins/cpu/linear.c > /tmp/old.c`), packed by its own
trtforge_pack_linear. On a shared machine run it under `flock` with whatever else benchmarks.
"""
# ruff: noqa: B023 - the timed lambdas run within the loop iteration that made them

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import time
from pathlib import Path

import torch

from trtforge.plugins import native
from trtforge.plugins.cpu import linear as cl

SHAPES = {"qkv": (896, 1152), "o": (896, 896), "gate_up": (896, 9728), "down": (4864, 896),
          "lm_head": (896, 151936)}  # name: (K, N)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.processor())
    except OSError:
        return platform.processor()


def sample(fn, target_s: float = 0.03) -> float:
    """Seconds per call of fn, over as many calls as fill ~target_s (at least one)."""
    t0 = time.perf_counter()
    fn()
    once = time.perf_counter() - t0
    calls = max(1, int(target_s / max(once, 1e-7)))
    if calls == 1:
        return once
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512,2048")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--baseline", type=Path, default=None, help="another linear.c to time as well")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lib = cl.library()
    if lib is None:
        raise SystemExit("linear.c could not be built here")
    base = None
    if args.baseline is not None:
        signatures = cl._SIGNATURES | {"trtforge_packed_panels": (ctypes.c_int64, [ctypes.c_int64])}
        base = native.load(args.baseline.resolve(), signatures, cl.LIBRARY.extra_flags)
        if base is None:
            raise SystemExit(f"{args.baseline} could not be built")
    print(f"cpu: {cpu_model()}  isa: {native.isa()}  threads: {args.threads}  torch {torch.__version__}  "
          f"load: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    head = f"{'shape':8s} {'K x N':>12s} {'m':>5s} {'oneDNN':>8s} {'packed':>8s} {'ratio':>6s}"
    print(head + (f" {'base':>8s} {'vs base':>7s}" if base else "") + "   (GFLOP/s)")
    torch.manual_seed(0)
    with torch.inference_mode():
        for name in args.shapes.split(","):
            k, n = SHAPES[name]
            w = torch.randn(n, k) * 0.02
            b = torch.randn(n) * 0.02 if name == "qkv" else None  # only the qkv projection has a bias
            packed = cl.pack(w, lib)
            base_packed = None
            if base is not None:
                base_packed = torch.empty(base.trtforge_packed_panels(n), k, cl.PANEL)
                base.trtforge_pack_linear(w.data_ptr(), n, k, base_packed.data_ptr(), args.threads)
            for m in map(int, args.rows.split(",")):
                x = torch.randn(m, k)
                y = torch.empty(m, n)
                bp = None if b is None else b.data_ptr()
                runs = {
                    "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], ""),
                    "packed": lambda: lib.trtforge_packed_linear(x.data_ptr(), m, packed.data_ptr(), bp, y.data_ptr(),
                                                                 n, k, args.threads),
                }
                if base is not None:
                    runs["base"] = lambda: base.trtforge_packed_linear(x.data_ptr(), m, base_packed.data_ptr(), bp,
                                                                       y.data_ptr(), n, k, args.threads)
                best = {key: float("inf") for key in runs}
                for _ in range(args.repeats):  # alternating: a load change hits every candidate alike
                    for key, fn in runs.items():
                        best[key] = min(best[key], sample(fn))
                flops = 2.0 * m * k * n
                g = {key: flops / t / 1e9 for key, t in best.items()}
                line = (f"{name:8s} {f'{k}x{n}':>12s} {m:5d} {g['onednn']:8.1f} {g['packed']:8.1f} "
                        f"{g['packed'] / g['onednn']:6.2f}")
                if base is not None:
                    line += f" {g['base']:8.1f} {g['packed'] / g['base']:7.2f}"
                print(line, flush=True)
    print(f"load after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
