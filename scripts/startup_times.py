"""Start-up times of the trtforge commands, each beside its target (a benchmark: MET/MISSED, never
a failing exit). Called by scripts/startup_times.sh, which builds the engines first.

    python scripts/startup_times.py WORK_DIR [--repeats 3]

WORK_DIR holds tiny/engine, tiny/repo and 05b/engine. Every figure is the best of `--repeats`
runs of a fresh process, plain wall-clock: on a shared machine the best run is the one least
disturbed by others.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent
PROMPT = "The quick brown fox"

# Runs in a fresh interpreter: imports first (untimed: they are the same for every model size),
# then the engine load, then two one-token generations (the first maps the weights on first touch).
_LOAD = """
import json, sys, time
import torch
from trtforge.serving.engine import LLMEngine
from trtforge.config.sampling import SamplingParams
t0 = time.perf_counter()
engine = LLMEngine.from_engine_dir(sys.argv[1])
t1 = time.perf_counter()
engine.generate(["The quick brown fox"], [SamplingParams(max_tokens=1)])
t2 = time.perf_counter()
engine.generate(["The quick brown fox"], [SamplingParams(max_tokens=1)])
t3 = time.perf_counter()
print(json.dumps({"load": t1 - t0, "first_token": t2 - t1, "next_token": t3 - t2}))
"""


def best_of(repeats: int, run) -> tuple[float, list[float]]:
    times = [run() for _ in range(repeats)]
    return min(times), times


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def serve_to_ready(repo: Path, log: Path) -> float:
    """`trtforge serve` until it prints that Triton is ready; then Ctrl-C and wait for it."""
    cmd = [str(BIN / "trtforge"), "serve", str(repo), "--http-port", "0", "--grpc-port", "0",
           "--metrics-port", "0", "--log-file", str(log)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            if "Triton is ready" in line:
                return time.perf_counter() - start
        raise RuntimeError(f"trtforge serve exited ({proc.wait()}) before ready; see {log}")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


def read_file(path: Path) -> float:
    """Read the whole file into one reused buffer (from the page cache once it is warm)."""
    buf = bytearray(4 << 20)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - start


def sha256_time(path: Path) -> float:
    start = time.perf_counter()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return time.perf_counter() - start


def load_runs(engine: Path, repeats: int) -> list[dict[str, float]]:
    runs = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", _LOAD, str(engine)], check=True,
                             capture_output=True, text=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    return runs


def line(name: str, value: float, target: float, runs: list[float], unit: str = "s") -> str:
    verdict = "MET" if value < target or (unit == "x" and value <= target) else "MISSED"
    shown = ", ".join(f"{r:.2f}" for r in runs)
    bound = f"<= {target:g}" if unit == "x" else f"< {target:g} s"
    return f"{name:<44} {value:6.2f} {unit:<2} target {bound:<10} {verdict:<6}  (runs: {shown})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    work, n = args.work, args.repeats
    trt = str(BIN / "trtforge")
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start; best of {n}")
    help_s, runs = best_of(n, lambda: timed([trt, "--help"]))
    print(line("trtforge --help", help_s, 1.0, runs))
    gen_s, runs = best_of(n, lambda: timed([trt, "generate", str(work / "tiny/engine"), "--prompt", PROMPT,
                                            "--max-tokens", "1"]))
    print(line("trtforge generate (tiny engine, 1 token)", gen_s, 3.0, runs))
    try:
        serve_s, runs = best_of(n, lambda: serve_to_ready(work / "tiny/repo", work / "triton.log"))
        print(line("trtforge serve (tiny repo) to ready", serve_s, 8.0, runs))
    except (FileNotFoundError, RuntimeError) as exc:
        print(f"trtforge serve: not measured ({exc})")
    weights = work / "05b/engine/rank0.safetensors"
    read_file(weights)  # warm the page cache
    read_s, reads = best_of(n, lambda: read_file(weights))
    loads = load_runs(work / "05b/engine", n)
    load_s = min(r["load"] for r in loads)
    size = weights.stat().st_size / 1e9
    print(f"{'read rank0.safetensors from the page cache':<44} {read_s:6.2f} s  ({size:.2f} GB, runs: "
          + ", ".join(f"{r:.2f}" for r in reads) + ")")
    print(line("0.5B engine load (LLMEngine.from_engine_dir)", load_s, 1.5 * read_s, [r["load"] for r in loads]))
    print(line("  ... as a multiple of the read", load_s / read_s, 1.5, [r["load"] / read_s for r in loads], "x"))
    first = min(r["first_token"] for r in loads)
    after = min(r["next_token"] for r in loads)
    print(f"  first 1-token generate {first:.2f} s, the next one {after:.2f} s (the first maps the weights in)")
    # The stricter view: mapping defers reading the weights to the first step, so charge it there.
    print(f"  load + first token {load_s + first:.2f} s vs read + next token {read_s + after:.2f} s: "
          f"{(load_s + first) / (read_s + after):.2f} x")
    print(f"  the first load after a build or copy also hashes the weights: sha256 {sha256_time(weights):.2f} s")


if __name__ == "__main__":
    main()
