"""The serving benchmark report (scripts/bench_serve.sh): two experiments in one run.

1. Serving overhead — the same requests (same prompts, same token counts, same concurrency) run
   through Triton (gRPC streaming, `bench serve`) and offline through LLMEngine in this process;
   the ratio of output-token throughputs is what Triton, gRPC and the python backend cost.
2. Prefill/decode interference — short decoding requests in a closed loop while long prompts
   arrive, on two servers one after the other: chunked prefill on (prefill_chunk_size > 0) and
   off (0). Reported: TPOT/ITL of the short requests, TTFT of the long ones.

Servers are started and stopped here (TritonServer); the engine must have been built with
max_num_tokens >= max_seq_len - 1 so that both scheduler configs are valid.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import click
import torch

from trtforge.bench.serve import ServeBenchConfig, build_workload, run_benchmark, summarize
from trtforge.bench.serve_metrics import RequestRecord, compute_metrics, format_table
from trtforge.config.sampling import SamplingParams
from trtforge.model_repo.emit import emit_repo
from trtforge.model_repo.launcher import TritonServer
from trtforge.models.tokenizer import load_tokenizer
from trtforge.serving.engine import LLMEngine


def machine() -> dict[str, Any]:
    """CPU model, cores and load average now (the benchmark shares this machine)."""
    model = platform.processor()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines()
                     if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        pass
    return {"cpu_model": model, "cores": os.cpu_count(), "loadavg_1_5_15": list(os.getloadavg()),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def run_offline(engine: LLMEngine, prompts: list[str], cfg: ServeBenchConfig
                ) -> tuple[list[RequestRecord], float]:
    """The bench-serve workload in-process: at most cfg.concurrency requests in flight, each
    admitted as soon as one finishes; timings from the engine's own per-token timestamps."""
    params = SamplingParams(max_tokens=cfg.output_len, min_tokens=cfg.output_len if cfg.ignore_eos else 0,
                            logprobs=0 if cfg.return_log_probs else None)
    limit = cfg.concurrency or len(prompts)
    pending, running, records = list(prompts), 0, []
    start = time.monotonic()
    while pending or engine.has_unfinished():
        while pending and running < limit:
            engine.add_request(pending.pop(0), params)
            running += 1
        for out in engine.step():
            if out.finished:
                running -= 1
                m = out.metrics
                records.append(RequestRecord(start=m.arrival_time, chunk_times=list(m.token_times),
                                             end=m.finished_time, prompt_len=out.num_prompt_tokens,
                                             output_len=len(out.output_token_ids), group="offline",
                                             error=out.error))
    return records, max(r.end for r in records) - start


def _offline_once(engine_dir: Path, sched: dict[str, Any], prompts: list[str], warm: str,
                  cfg: ServeBenchConfig, title: str) -> dict[str, Any]:
    """One offline pass on a freshly loaded engine (no prefix cache left from an earlier pass)."""
    engine = LLMEngine.from_engine_dir(engine_dir, **sched)
    engine.generate([warm], SamplingParams(max_tokens=2))  # same warm-up as the served run
    records, seconds = run_offline(engine, prompts, cfg)
    del engine
    gc.collect()
    metrics = compute_metrics(records, seconds)
    return {**metrics.to_dict(), "table": format_table(title, metrics)}


def overhead(engine_dir: Path, repo: Path, cfg: ServeBenchConfig, sched: dict[str, Any],
             log: Callable[[str], None], out: Path) -> dict[str, Any]:
    """Experiment 1: offline, Triton, offline again (the machine is shared: the two offline passes
    bracket the served one, so a change of background load shows as a gap between them)."""
    main, _, warm = build_workload(cfg, load_tokenizer(engine_dir))
    log(f"overhead: offline LLMEngine, {len(main)} requests (load {machine()['loadavg_1_5_15']})")
    before = _offline_once(engine_dir, sched, main, warm, cfg, "Offline LLMEngine (before)")
    log(f"overhead: Triton, same requests (load {machine()['loadavg_1_5_15']})")
    with TritonServer(repo, log_file=out / "server_overhead.log") as server:
        served_cfg = dataclasses.replace(cfg, url=server.grpc_url)
        records, duration = asyncio.run(run_benchmark(served_cfg, main, [], warm))
    served = summarize(served_cfg, records, duration)
    log(f"overhead: offline again (load {machine()['loadavg_1_5_15']})")
    after = _offline_once(engine_dir, sched, main, warm, cfg, "Offline LLMEngine (after)")
    offline_tps = (before["output_throughput"] + after["output_throughput"]) / 2
    return {"offline_before": before, "offline_after": after, "triton": served,
            "ratio_output_throughput": served["metrics"]["main"]["output_throughput"] / offline_tps,
            "machine_after": machine()}


def interference(repo: Path, cfg: ServeBenchConfig, engine_dir: Path, label: str,
                 log: Callable[[str], None], out: Path) -> dict[str, Any]:
    """Experiment 2 on one repository (one scheduler configuration)."""
    main, long, warm = build_workload(cfg, load_tokenizer(engine_dir))
    log(f"interference [{label}]: starting server ({machine()['loadavg_1_5_15']})")
    with TritonServer(repo, log_file=out / f"server_{label}.log") as server:
        run_cfg = dataclasses.replace(cfg, url=server.grpc_url)
        log(f"interference [{label}]: running ({machine()['loadavg_1_5_15']})")
        records, duration = asyncio.run(run_benchmark(run_cfg, main, long, warm))
    report = summarize(run_cfg, records, duration)
    report["machine_after"] = machine()
    return report


@click.command()
@click.option("--engine", "engine_dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              required=True, help="Engine built with max_num_tokens >= max_seq_len - 1.")
@click.option("--out", "out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Where repositories, server logs and report.json go.")
@click.option("--chunk", type=int, default=16, show_default=True,
              help="prefill_chunk_size of the chunked interference run. Small on a CPU: a chunk rides along "
                   "with the decodes almost for free only while its compute hides behind the weight reads "
                   "of the decode step (~16 tokens here); bigger chunks just move the stall around.")
@click.option("--overhead-chunk", type=int, default=256, show_default=True,
              help="prefill_chunk_size of the serving-overhead experiment (served and offline alike).")
@click.option("--threads", type=int, default=1, show_default=True,
              help="Intra-op threads of the engine, offline and in the server alike (OMP_NUM_THREADS). "
                   "On a small machine shared with other jobs, 2 OpenMP threads on 2 cores wait at every "
                   "barrier for a descheduled thread: decode steps measured 4x slower than with 1.")
@click.option("--overhead-requests", type=int, default=16, show_default=True)
@click.option("--overhead-concurrency", type=int, default=8, show_default=True)
@click.option("--overhead-input-len", type=int, default=64, show_default=True)
@click.option("--overhead-output-len", type=int, default=32, show_default=True)
@click.option("--short-concurrency", type=int, default=8, show_default=True)
@click.option("--short-input-len", type=int, default=32, show_default=True)
@click.option("--short-output-len", type=int, default=24, show_default=True,
              help="Tokens each short request generates (a short chat reply).")
@click.option("--long-num", type=int, default=2, show_default=True)
@click.option("--long-input-len", type=int, default=2000, show_default=True)
@click.option("--long-start-s", type=float, default=15.0, show_default=True)
@click.option("--long-interval-s", type=float, default=90.0, show_default=True,
              help="Seconds between long prompts: long enough that one chunked 2,000-token prefill "
                   "(~125 iterations of 16 tokens) ends before the next prompt arrives.")
def main(engine_dir: Path, out: Path, chunk: int, overhead_chunk: int, threads: int, **o: Any) -> None:
    """Run both experiments and write OUT/report.json (printing the tables)."""
    out.mkdir(parents=True, exist_ok=True)
    # The servers inherit it (the launcher only sets a default); this process runs the offline engine.
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        click.echo(f"[{time.perf_counter() - t0:7.1f} s] {msg}", err=True)

    report: dict[str, Any] = {"machine_start": machine(), "engine": str(engine_dir), "threads": threads,
                              "chunk": chunk, "overhead_chunk": overhead_chunk, "options": o}
    overhead_repo = emit_repo(engine_dir, out / "repo_overhead", prefill_chunk_size=overhead_chunk)
    repos = {"chunked": emit_repo(engine_dir, out / "repo_chunked", prefill_chunk_size=chunk),
             "unchunked": emit_repo(engine_dir, out / "repo_unchunked", prefill_chunk_size=0)}
    cfg = ServeBenchConfig(num_prompts=o["overhead_requests"], input_len=o["overhead_input_len"],
                           output_len=o["overhead_output_len"], concurrency=o["overhead_concurrency"])
    report["overhead"] = overhead(engine_dir, overhead_repo, cfg, {"prefill_chunk_size": overhead_chunk}, log, out)
    short = ServeBenchConfig(num_prompts=1000, input_len=o["short_input_len"], output_len=o["short_output_len"],
                             concurrency=o["short_concurrency"], long_num=o["long_num"],
                             long_input_len=o["long_input_len"], long_start_s=o["long_start_s"],
                             long_interval_s=o["long_interval_s"])
    report["interference"] = {label: interference(repo, short, engine_dir, label, log, out)
                              for label, repo in repos.items()}
    report["wall_s"] = time.perf_counter() - t0
    (out / "report.json").write_text(json.dumps(report, indent=2))
    click.echo(render(report))
    log(f"report: {out / 'report.json'}")


def _pct(dist: dict[str, Any], p: int) -> float:
    """A percentile of a Distribution dict, before (int keys) or after (str keys) a JSON trip."""
    values = dist["percentiles"]
    return values[p] if p in values else values[str(p)]


def render(report: dict[str, Any]) -> str:
    """The headline numbers, then every table."""
    ov, inter = report["overhead"], report["interference"]
    served = ov["triton"]["metrics"]["main"]["output_throughput"]
    lines = [f"serving overhead: Triton/offline output-token throughput = {ov['ratio_output_throughput']:.3f} "
             f"(Triton {served:.2f} tok/s; offline before {ov['offline_before']['output_throughput']:.2f}, "
             f"after {ov['offline_after']['output_throughput']:.2f}; target >= 0.9)"]
    short = {k: v["metrics"]["main"] for k, v in inter.items()}
    long = {k: v["metrics"].get("long") for k, v in inter.items()}
    tpot = {k: _pct(m["tpot_ms"], 99) for k, m in short.items()}
    lines.append(f"interference: short-request TPOT p99 chunked {tpot['chunked']:.0f} ms, unchunked "
                 f"{tpot['unchunked']:.0f} ms: ratio {tpot['chunked'] / tpot['unchunked']:.3f} (target <= 0.5)")
    lines.append("  ITL p99 / max (ms): " + ", ".join(
        f"{k} {_pct(m['itl_ms'], 99):.0f} / {m['itl_ms']['max']:.0f}" for k, m in short.items()))
    lines.append("  long-prompt TTFT p50 (ms): " + ", ".join(
        f"{k} {_pct(m['ttft_ms'], 50):.0f}" if m else f"{k} n/a" for k, m in long.items()))
    lines += [ov["offline_before"]["table"], *ov["triton"]["tables"].values(), ov["offline_after"]["table"]]
    for label, rep in inter.items():
        lines += [f"--- interference: {label} ---", *rep["tables"].values()]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
