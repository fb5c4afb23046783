"""Multi-turn chat over trtforge workers, three routers in the same run: NVIDIA Dynamo's frontend
with KV-aware routing (fed by our KV events), the same frontend with round-robin, and trtforge's
own router (Triton) with prefix affinity.

    python scripts/bench_dynamo_multiturn.py [ENGINE_DIR] [--workers 2] [--sessions 8] [--turns 4]
        [--repeats 2] [--json out/bench_dynamo/multiturn.json]

Without ENGINE_DIR it builds the tiny demo engine (as the e2e tests do). Two fleets, both on
loopback: `trtforge dynamo-worker`s with one Dynamo frontend per router mode over them, and
`trtforge serve` workers (a plain repository each) behind a router server
(`emit-repo --only router --worker-url …`) with the OpenAI endpoint in front; the same number of
workers and the same scheduling (--schedule) in both. The runs alternate (kv, round-robin,
trtforge router, kv, ...), each with its own conversations (no prefix shared between runs). Both
fleets stay up, and the one not measured is idle: its CPU use during every run is measured and
printed (a fleet that was not quiet would skew the others' numbers on a small machine). Printed per
run: output tok/s, TTFT p50/p99, and the share of later turns' prompt tokens the workers served from
their prefix cache.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trtforge.bench.dynamo_fleet import (
    BIN,
    cpu_seconds,
    start_frontend,
    start_triton_fleet,
    start_worker,
    wait_ready,
)
from trtforge.bench.multiturn import MultiTurnConfig, run
from trtforge.bench.serve_report import machine

MODEL = "tiny"
OURS = "trtforge router"
TINY_BUILD = ["--dtype", "float32", "--max-batch-size", "32", "--max-num-tokens", "256",
              "--max-seq-len", "2048", "--kv-block-size", "8", "--kv-cache-memory", "8MiB"]


def _tiny_engine(root: Path) -> Path:
    subprocess.run([str(BIN / "trtforge"), "demo-checkpoint", str(root / "ckpt"), "--arch", "qwen2",
                    "--size", "tiny"], check=True, capture_output=True)
    subprocess.run([str(BIN / "build-engine"), str(root / "ckpt"), "--output", str(root / "engine"), "-q",
                    *TINY_BUILD], check=True)
    return root / "engine"


def _idle_cpu(fleets: dict[str, list], seconds: float) -> dict[str, float]:
    """Cores each fleet's processes use while nothing is sent to any of them."""
    before = {name: cpu_seconds(procs) for name, procs in fleets.items()}
    time.sleep(seconds)
    return {name: (cpu_seconds(procs) - before[name]) / seconds for name, procs in fleets.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine_dir", nargs="?", type=Path)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--context-words", type=int, default=150)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--schedule", action="append", default=["prefill_chunk_size=64"],
                    help="worker --schedule KEY=VALUE (default prefill_chunk_size=64)")
    ap.add_argument("--json", type=Path, default=Path("out/bench_dynamo/multiturn.json"))
    a = ap.parse_args()
    cfg = MultiTurnConfig(sessions=a.sessions, turns=a.turns, context_words=a.context_words,
                          max_tokens=a.max_tokens)
    root = Path(tempfile.mkdtemp(prefix="trtforge-dynamo-bench-"))
    (root / "discovery").mkdir()
    engine = a.engine_dir or _tiny_engine(root)
    sched = [x for kv in a.schedule for x in ("--schedule", kv)]
    procs, urls = [], {}
    try:
        workers = [start_worker(root, engine, f"worker{i}", *sched, model=MODEL) for i in range(a.workers)]
        procs += workers
        for mode in ("kv", "round-robin"):
            frontend, urls[mode] = start_frontend(root, mode)
            procs.append(frontend)
        wait_ready(procs, list(urls.values()), workers, model=MODEL)
        dynamo = list(procs)
        emit_options = [x for kv in a.schedule for x in ("--" + kv.split("=", 1)[0].replace("_", "-"),
                                                         kv.split("=", 1)[1])]
        triton, urls[OURS] = start_triton_fleet(root, engine, a.workers, emit_options, model=MODEL)
        procs += triton
        fleets = {"dynamo": dynamo, "triton": triton}
        for url in urls.values():
            run(url, MODEL, MultiTurnConfig(sessions=2, turns=1, context_words=10, max_tokens=2), "warm")
        idle = _idle_cpu(fleets, 3.0)
        print("idle fleets, CPU use (cores): " + ", ".join(f"{k} {v:.3f}" for k, v in idle.items()), flush=True)
        report = {"machine": machine(), "engine": str(engine), "config": vars(cfg), "workers": a.workers,
                  "schedule": a.schedule, "idle_fleet_cpu_cores": idle, "runs": {mode: [] for mode in urls}}
        for rep in range(a.repeats):
            for mode, url in urls.items():
                other = fleets["dynamo" if mode == OURS else "triton"]
                other_before = cpu_seconds(other)
                result = run(url, MODEL, cfg, f"{mode.replace(' ', '-')}-{rep}")
                result["idle_fleet_cpu_cores"] = (cpu_seconds(other) - other_before) / result["duration_s"]
                m = result["metrics"]
                print(f"{mode:15s} run {rep}: {m['output_throughput']:7.1f} out tok/s, TTFT p50 "
                      f"{m['ttft_ms']['percentiles'][50]:7.1f} ms p99 {m['ttft_ms']['percentiles'][99]:7.1f} ms, "
                      f"later turns cached {100 * result['later_turns_cached_fraction']:5.1f} %, "
                      f"{m['completed']} ok / {m['failed']} failed; the other fleet used "
                      f"{result['idle_fleet_cpu_cores']:.3f} cores", flush=True)
                report["runs"][mode].append({k: v for k, v in result.items() if k != "turns"})
        best = {mode: max(r["metrics"]["output_throughput"] for r in runs) for mode, runs in report["runs"].items()}
        p50 = {mode: min(r["metrics"]["ttft_ms"]["percentiles"][50] for r in runs)
               for mode, runs in report["runs"].items()}
        for name, (num, den) in (("kv_over_round_robin", ("kv", "round-robin")),
                                 ("trtforge_router_over_round_robin", (OURS, "round-robin")),
                                 ("trtforge_router_over_kv", (OURS, "kv"))):
            report[name] = {"output_throughput": best[num] / best[den], "ttft_p50": p50[num] / p50[den]}
            print(f"{num} / {den} (best of {a.repeats}): output tok/s {report[name]['output_throughput']:.2f}x, "
                  f"TTFT p50 {report[name]['ttft_p50']:.2f}x")
        print(f"load at start {report['machine']['loadavg_1_5_15']}")
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(report, indent=1))
        print(f"wrote {a.json}")
    finally:
        for p in procs:
            p.stop()


if __name__ == "__main__":
    sys.exit(main())
