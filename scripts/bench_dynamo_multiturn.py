"""Multi-turn chat through NVIDIA Dynamo's frontend over trtforge workers: KV-aware routing (fed by
our KV events) against round-robin over the same workers, in the same run.

    python scripts/bench_dynamo_multiturn.py [ENGINE_DIR] [--workers 2] [--sessions 8] [--turns 4]
        [--repeats 2] [--json out/bench_dynamo/multiturn.json]

Without ENGINE_DIR it builds the tiny demo engine (as the e2e tests do). One frontend per router
mode runs over the same workers; the runs alternate (kv, round-robin, kv, ...), each with its own
conversations (no prefix shared between runs). Printed per run: output tok/s, TTFT p50/p99, and
the share of later turns' prompt tokens the workers served from their prefix cache.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from trtforge.bench.dynamo_fleet import BIN, start_frontend, start_worker, wait_ready
from trtforge.bench.multiturn import MultiTurnConfig, run
from trtforge.bench.serve_report import machine

MODEL = "tiny"
TINY_BUILD = ["--dtype", "float32", "--max-batch-size", "32", "--max-num-tokens", "256",
              "--max-seq-len", "2048", "--kv-block-size", "8", "--kv-cache-memory", "8MiB"]


def _tiny_engine(root: Path) -> Path:
    subprocess.run([str(BIN / "trtforge"), "demo-checkpoint", str(root / "ckpt"), "--arch", "qwen2",
                    "--size", "tiny"], check=True, capture_output=True)
    subprocess.run([str(BIN / "build-engine"), str(root / "ckpt"), "--output", str(root / "engine"), "-q",
                    *TINY_BUILD], check=True)
    return root / "engine"


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
        run(urls["kv"], MODEL, MultiTurnConfig(sessions=2, turns=1, context_words=10, max_tokens=2), "warm")
        report = {"machine": machine(), "engine": str(engine), "config": vars(cfg), "workers": a.workers,
                  "schedule": a.schedule, "runs": {"kv": [], "round-robin": []}}
        for rep in range(a.repeats):
            for mode, url in urls.items():
                result = run(url, MODEL, cfg, f"{mode}-{rep}")
                m = result["metrics"]
                print(f"{mode:12s} run {rep}: {m['output_throughput']:7.1f} out tok/s, TTFT p50 "
                      f"{m['ttft_ms']['percentiles'][50]:7.1f} ms p99 {m['ttft_ms']['percentiles'][99]:7.1f} ms, "
                      f"later turns cached {100 * result['later_turns_cached_fraction']:5.1f} %, "
                      f"{m['completed']} ok / {m['failed']} failed", flush=True)
                report["runs"][mode].append({k: v for k, v in result.items() if k != "turns"})
        best = {mode: max(r["metrics"]["output_throughput"] for r in runs) for mode, runs in report["runs"].items()}
        p50 = {mode: min(r["metrics"]["ttft_ms"]["percentiles"][50] for r in runs)
               for mode, runs in report["runs"].items()}
        report["kv_over_round_robin"] = {"output_throughput": best["kv"] / best["round-robin"],
                                         "ttft_p50": p50["kv"] / p50["round-robin"]}
        ratio = report["kv_over_round_robin"]
        print(f"kv / round-robin (best of {a.repeats}): output tok/s {ratio['output_throughput']:.2f}x, "
              f"TTFT p50 {ratio['ttft_p50']:.2f}x; load at start {report['machine']['loadavg_1_5_15']}")
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(report, indent=1))
        print(f"wrote {a.json}")
    finally:
        for p in procs:
            p.stop()


if __name__ == "__main__":
    sys.exit(main())
