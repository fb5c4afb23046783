"""Decode tok/s of pre-quantized GPTQ int4 engines against our own int4_wo engine of the same checkpoint.

    .venv/bin/python scripts/bench_prequantized.py [--checkpoint out/bench_peers/ckpt] [--out out/bench_prequantized]
        [--batch 1 --batch 16 --batch 64] [--rounds 2] [--context 32]

From one float checkpoint (default: the Qwen2.5-0.5B-shaped random one `trtforge demo-checkpoint DIR --arch qwen2
--size 0.5b` writes) it writes two GPTQ 4-bit group-128 checkpoints — symmetric and asymmetric (sym=false:
random zero points) — with the test helpers of tests/builder/prequantized_checkpoints.py (random codes and
scales in the real GPTQ v1 layout; speed does not depend on their values), builds them and our own
`--quantization int4_wo --group-size 128 --no-quantize-lm-head` engine of the float checkpoint (float32; the
LM head float in all three, as a pre-quantized build keeps the checkpoint's, so only the decoder linears
differ), then runs scripts/profile_decode.py on each engine, interleaved, `--rounds` times (0: write and
build only) — and, unless --no-module-path, the asymmetric engine with no decode plan too (its decode steps
through the modules, as before the plan took zero points). Every build and every measurement holds
`flock /tmp/bench.lock`; the load average is printed before each. The table: the best tok/s of the rounds
per engine and batch, with the least time of the step's linears run alone (profile_decode's "linears": the
modules, not the plan).
Not a test: a measurement to read (docs/quantization.md, "Pre-quantized checkpoints").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.builder.prequantized_checkpoints
PY, TRTFORGE = str(ROOT / ".venv/bin/python"), str(ROOT / ".venv/bin/trtforge")
GROUP = 128
NO_PLAN = ("import runpy, sys; from trtforge.serving.worker import cpu_decode_plan as p; "
           "p.CpuDecodePlan.build = classmethod(lambda cls, *a, **k: None); sys.argv = {argv!r}; "
           "runpy.run_path(sys.argv[0], run_name='__main__')")
"""profile_decode.py with no CPU decode plan: every decode step through the network's modules (as
pre-quantized layers with zero points ran before the plan took them)."""


def write_gptq(src: Path, dst: Path, sym: bool) -> None:
    """A GPTQ v1 4-bit group-128 checkpoint of `src`'s shape: every decoder projection random codes."""
    import torch
    from safetensors.torch import load_file, save_file

    from tests.builder.prequantized_checkpoints import CASES, PROJECTIONS, _gptq, _random_layer, quantization_config

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    tensors = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(26 + sym)
    out = {}
    for name, t in tensors.items():
        module = name[: -len(".weight")]
        if not (name.endswith(".weight") and module.split(".layers.")[-1].split(".", 1)[-1] in PROJECTIONS):
            out[name] = t
            continue
        q, scales, z = _random_layer(g, *t.shape, 4, GROUP, sym, torch.float16)
        out.update(_gptq(module, q, scales, z, 4, None))
    del tensors
    save_file({k: v.contiguous() for k, v in out.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    case = f"bench-gptq-{'sym' if sym else 'asym'}"
    CASES[case] = dict(arch="qwen2", fmt="gptq", bits=4, group=GROUP, sym=sym)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(case)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))


def locked(cmd: list[str]) -> str:
    print(f"load average {os.getloadavg()}: {' '.join(cmd)}", flush=True)
    done = subprocess.run(["flock", "/tmp/bench.lock", *cmd], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{cmd} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "out/bench_peers/ckpt")
    ap.add_argument("--out", type=Path, default=ROOT / "out/bench_prequantized")
    ap.add_argument("--batch", type=int, action="append", help="decode rows per step (default 1, 16, 64)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--module-path", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the asymmetric engine without the CPU decode plan (the module path)")
    args = ap.parse_args()
    batches = args.batch or [1, 16, 64]
    engines = {}
    for name, sym in (("gptq-sym", True), ("gptq-asym", False)):
        ckpt = args.out / f"{name}-ckpt"
        if not (ckpt / "config.json").exists():
            print(f"writing {ckpt}", flush=True)
            write_gptq(args.checkpoint, ckpt, sym)
        engines[name] = (ckpt, [])
    engines = {"int4_wo (ours)": (args.checkpoint, ["--quantization", "int4_wo", "--group-size", str(GROUP),
                                                         "--no-quantize-lm-head"]),
               **engines}
    dirs = {}
    for name, (ckpt, flags) in engines.items():
        out = args.out / f"{name.split()[0]}-engine"
        if not (out / "engine.json").exists():
            locked([TRTFORGE, "build", str(ckpt), "-o", str(out), "--force", "-q", "--dtype", "float32",
                    "--max-batch-size", str(max(batches)), *flags])
        dirs[name] = out
    if not args.rounds:
        return
    runs = dict(dirs)
    if args.module_path:
        runs["gptq-asym, no plan"] = dirs["gptq-asym"]
    results: dict[str, dict[int, float]] = {name: {} for name in runs}
    linears: dict[str, dict[int, float]] = {name: {} for name in runs}
    flags = [a for b in batches for a in ("--batch", str(b))]
    for r in range(args.rounds):
        for name, out in runs.items():
            argv = ["scripts/profile_decode.py", str(out), *flags, "--context", str(args.context),
                    "--steps", str(args.steps)]
            cmd = [PY, *argv] if not name.endswith("no plan") else [PY, "-c", NO_PLAN.format(argv=argv)]
            text = locked(cmd)
            if r == 0:
                print("\n".join(ln for ln in text.splitlines() if ln.startswith(("CPU:", "kernels:"))))
            for b, tps, block in re.findall(r"^batch (\d+), context \d+: ([\d.]+) tok/s\n((?:  .*\n?)*)", text, re.M):
                b = int(b)
                results[name][b] = max(results[name].get(b, 0.0), float(tps))
                lin = float(re.search(r"^    linears\s+([\d.]+) ms", block, re.M).group(1))
                linears[name][b] = min(linears[name].get(b, 1e9), lin)
                print(f"round {r + 1} {name:<20} batch {b:>3}: {float(tps):7.1f} tok/s, linears {lin:7.1f} ms",
                      flush=True)
    ours = results["int4_wo (ours)"]
    print(f"\n| engine | {' | '.join(f'batch {b}: tok/s (linears ms)' for b in batches)} |")
    print("|---|" + "---|" * len(batches))
    for name, res in results.items():
        cells = [f"{res[b]:.1f}" + ("" if res is ours else f" = {res[b] / ours[b]:.2f}x") + f" ({linears[name][b]:.1f})"
                 for b in batches]
        print(f"| {name} | {' | '.join(cells)} |")
    print(f"load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
