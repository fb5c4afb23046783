"""Time the paged-attention op's CPU path against the reference and a naive per-sequence baseline,
and the C decode kernel on whole decode steps.

    python scripts/bench_attention_cpu.py [--dtype float32|bfloat16] [--threads N] [--json F]
        [--layers 24] [--compare-source OLD_cpu_decode.c] [--int8-kv]

Shapes are Qwen2.5-0.5B's attention (Hq=14, Hkv=2, D=64), block size 16. "naive" is what a
straightforward torch port would do: per sequence, gather its blocks, repeat KV heads for GQA and
call SDPA with an offset-causal mask. All three run on the same inputs in the same process;
each number is the best of --repeats wall-clock runs (reference: one run), in milliseconds.

Decode steps (float32 only): the C decode kernel (plugins/paged_attention/cpu_decode.c, the ISA of
`TRTFORGE_CPU_ISA` or the CPU's) on `--layers` layers' pools called back to back, as a model's step
does, so the KV comes from memory rather than from a cache that one layer's pool would fit; ms per
layer and the K/V bytes read per second. `--compare-source` builds another version of the kernel
(e.g. `git show HEAD:plugins/paged_attention/cpu_decode.c > /tmp/old.c`) with the same flags and
times it on the same pools, the two interleaved repeat by repeat.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from trtforge.plugins import native
from trtforge.plugins.paged_attention import cpu, cpu_native, reference
from trtforge.plugins.paged_attention.testing import make_case

WORKLOADS = {
    "decode 32 seqs x 512 ctx": [(511, 1)] * 32,
    "prefill 512 tokens": [(0, 512)],
    "mixed: 256-token chunk after 256 + 31 decodes x 512": [(256, 256)] + [(511, 1)] * 31,
}
DECODE_STEPS = {
    "64 seqs x 256 ctx (profile_decode's step)": [(255, 1)] * 64,
    "16 seqs x 256 ctx": [(255, 1)] * 16,
    "long/short: 1 x 4096 + 63 x 256": [(4095, 1)] + [(255, 1)] * 63,
    "1 seq x 4096 ctx": [(4095, 1)],
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


def decode_step_ms(libs: dict[str, object], seqs, layers: int, repeats: int, int8_kv: bool) -> dict[str, float]:
    """Best ms per layer of each library's decode kernel over `layers` pools, interleaved."""
    cases = [make_case(seqs, block_size=16, num_heads=14, num_kv_heads=2, head_dim=64, seed=i,
                       spare_blocks=0) for i in range(layers)]
    if int8_kv:
        cases = [c.int8_kv() for c in cases]
    best = {name: float("inf") for name in libs}
    for _ in range(repeats + 1):  # the first round warms up
        for name, lib in libs.items():
            cpu_native.LIBRARY.lib = lib
            start = time.perf_counter()
            for case in cases:
                cpu_native.decode(*case.op_args()[:7], case.scale, case.kv_scales)
            best[name] = min(best[name], (time.perf_counter() - start) / layers * 1e3)
    return best


def decode_steps(args) -> list[dict]:
    libs = {"kernel": cpu_native.library()}
    if args.compare_source:
        libs["compared"] = native.NativeLibrary(Path(args.compare_source), cpu_native._SIGNATURES,
                                                cpu_native.LIBRARY.extra_flags).get()
    if any(lib is None for lib in libs.values()):
        raise SystemExit("the C decode kernel does not build here (see the log)")
    elem = 1 if args.int8_kv else 4
    print(f"\ndecode steps: C kernel ({native.isa()}), {args.layers} layers' pools, "
          f"{'int8' if args.int8_kv else 'float32'} KV, ms per layer (K/V GB/s)")
    rows = []
    for name, seqs in DECODE_STEPS.items():
        ms = decode_step_ms(libs, seqs, args.layers, args.repeats, args.int8_kv)
        kv_bytes = 2 * sum(c + n for c, n in seqs) * 2 * 64 * elem  # K and V, Hkv=2, D=64
        cells = "  ".join(f"{k} {v:7.3f} ({kv_bytes / v / 1e6:5.1f})" for k, v in ms.items())
        ratio = f"  compared / kernel {ms['compared'] / ms['kernel']:.2f}x" if "compared" in ms else ""
        print(f"  {name:44s} {cells}{ratio}")
        rows.append({"workload": f"decode step: {name}", "isa": native.isa(), "layers": args.layers,
                     "int8_kv": args.int8_kv, **{f"{k}_ms_per_layer": v for k, v in ms.items()}})
    cpu_native.LIBRARY.lib = libs["kernel"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--layers", type=int, default=24, help="decode steps: layers (pools) per step")
    parser.add_argument("--compare-source", help="decode steps: also time this version of cpu_decode.c")
    parser.add_argument("--int8-kv", action="store_true", help="decode steps: int8 KV pools")
    parser.add_argument("--only-decode", action="store_true", help="skip the op workloads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    rows = []
    cpu_model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
                     "?")
    print(f"CPU: {cpu_model} ({native.detected_isa()}); torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads, {args.dtype}")
    if not args.only_decode:
        print(f"{'workload (ms)':55s} {'reference':>10s} {'naive':>9s} {'cpu':>8s} {'vs ref':>7s} "
              f"{'vs naive':>8s}")
    for name, seqs in ({} if args.only_decode else WORKLOADS).items():
        case = make_case(seqs, block_size=16, num_heads=14, num_kv_heads=2, head_dim=64,
                         dtype=dtype, spare_blocks=64)
        ms = {"reference": best_ms(reference.paged_attention, case, 1, warmup=False),
              "naive": best_ms(naive, case, args.repeats),
              "cpu": best_ms(cpu.paged_attention, case, args.repeats)}
        rows.append({"workload": name, "dtype": args.dtype, "threads": torch.get_num_threads(),
                     **{f"{k}_ms": v for k, v in ms.items()}})
        print(f"{name:55s} {ms['reference']:10.1f} {ms['naive']:9.2f} {ms['cpu']:8.2f} "
              f"{ms['reference'] / ms['cpu']:6.0f}x {ms['naive'] / ms['cpu']:7.1f}x")
    if dtype is torch.float32:
        rows += decode_steps(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
