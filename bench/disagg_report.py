"""`trtforge bench disaggregated`: a co-located and a disaggregated repository of the same engine,
the same workload, one run (docs/benchmarks.md "Disaggregated serving").

The workload is the serving report's long-prompt-arrival experiment: short requests in a closed
loop (the decode-bound traffic) while long prompts arrive at fixed times (the prefill-bound
traffic). Two servers, one after the other:

* co-located: one `ensemble` model, chunked prefill (prefill and decode share every iteration);
* disaggregated: `ensemble` router → `context` pinned to some cores, `generation` to others.

Goodput counts the short requests that meet TTFT ≤ X and TPOT ≤ Y, with X and Y the co-located
run's medians (stated in the report): the share of requests served at least as well as the
co-located median case. The handoff cost comes from the phase models' metrics.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path
from typing import Any

import click


def _scrape(metrics_url: str) -> dict[str, dict[str, float]]:
    """{model: {metric: value}} of the trtforge_* counters and gauges (no histograms)."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if not line.startswith("trtforge_") or "_bucket" in line or "{" not in line:
            continue
        name, value = line.rsplit(" ", 1)
        model = name.split('model="', 1)[1].split('"', 1)[0]
        out.setdefault(model, {})[name.split("{")[0]] = float(value)
    return out


def run_one(label: str, repo: Path, cfg: Any, engine_dir: Path, out: Path, log) -> dict[str, Any]:
    import asyncio
    import dataclasses

    from trtforge.bench.serve import build_workload, run_benchmark
    from trtforge.bench.serve_report import machine
    from trtforge.model_repo.launcher import TritonServer
    from trtforge.models.tokenizer import load_tokenizer

    main, long, warm = build_workload(cfg, load_tokenizer(engine_dir))
    log(f"[{label}] starting server (load {machine()['loadavg_1_5_15']})")
    with TritonServer(repo, log_file=out / f"server_{label}.log") as server:
        run_cfg = dataclasses.replace(cfg, url=server.grpc_url)
        log(f"[{label}] running")
        records, duration = asyncio.run(run_benchmark(run_cfg, main, long, warm))
        scraped = _scrape(server.metrics_url)
    return {"records": records, "duration": duration, "server_metrics": scraped, "machine_after": machine()}


def summarize(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    from trtforge.bench.serve_metrics import SLO, compute_metrics

    base = compute_metrics([r for r in runs["colocated"]["records"] if r.group == "main"],
                           runs["colocated"]["duration"])
    slo = SLO(ttft_ms=base.ttft_ms.percentiles[50], tpot_ms=base.tpot_ms.percentiles[50])
    result: dict[str, Any] = {"slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms,
                                      "rule": "the co-located run's short-request medians"}}
    for label, run in runs.items():
        groups = {g: compute_metrics([r for r in run["records"] if r.group == g], run["duration"], slo)
                  for g in ("main", "long")}
        entry = {g: m.to_dict() for g, m in groups.items()}
        entry["all_output_throughput"] = sum(m.output_throughput for m in groups.values())
        entry["server_metrics"] = run["server_metrics"]
        entry["machine_after"] = run["machine_after"]
        if label == "disaggregated":
            ctx, gen = run["server_metrics"].get("context", {}), run["server_metrics"].get("generation", {})
            n = max(ctx.get("trtforge_kv_handoffs_total", 0), 1)
            seconds = ctx.get("trtforge_kv_handoff_seconds_total", 0) + gen.get("trtforge_kv_handoff_seconds_total", 0)
            nbytes = ctx.get("trtforge_kv_handoff_bytes_total", 0)
            ttft_p50 = groups["main"].ttft_ms.percentiles[50]
            entry["handoff"] = {"count": ctx.get("trtforge_kv_handoffs_total", 0),
                                "expired": ctx.get("trtforge_kv_handoffs_expired_total", 0),
                                "bytes_per_handoff": nbytes / n, "ms_per_handoff": 1e3 * seconds / n,
                                "share_of_short_ttft_p50": 1e3 * seconds / n / ttft_p50 if ttft_p50 else None}
        result[label] = entry
    return result


def render(summary: dict[str, Any]) -> str:
    def p(entry, group, metric, q):
        d = entry[group][metric]["percentiles"]
        return d.get(q, d.get(str(q)))

    co, dis = summary["colocated"], summary["disaggregated"]
    slo = summary["slo"]
    rows = [f"SLO for goodput (co-located short-request medians): TTFT <= {slo['ttft_ms']:.0f} ms, "
            f"TPOT <= {slo['tpot_ms']:.1f} ms",
            f"{'':34}{'co-located':>14}{'disaggregated':>16}{'ratio':>9}"]

    def row(name, a, b, fmt="{:.1f}"):
        ratio = b / a if a else float("nan")
        rows.append(f"{name:34}{fmt.format(a):>14}{fmt.format(b):>16}{ratio:>9.2f}")

    row("short TPOT p50 (ms)", p(co, "main", "tpot_ms", 50), p(dis, "main", "tpot_ms", 50))
    row("short TPOT p99 (ms)", p(co, "main", "tpot_ms", 99), p(dis, "main", "tpot_ms", 99))
    row("short TTFT p50 (ms)", p(co, "main", "ttft_ms", 50), p(dis, "main", "ttft_ms", 50))
    row("long-prompt TTFT p50 (ms)", p(co, "long", "ttft_ms", 50), p(dis, "long", "ttft_ms", 50))
    row("output tok/s (all requests)", co["all_output_throughput"], dis["all_output_throughput"], "{:.2f}")
    row("goodput (short req/s)", co["main"]["goodput"], dis["main"]["goodput"], "{:.3f}")
    h = dis.get("handoff", {})
    if h:
        rows.append(f"handoffs: {h['count']:.0f} ({h['expired']:.0f} expired), "
                    f"{h['bytes_per_handoff'] / 1e6:.2f} MB and {h['ms_per_handoff']:.2f} ms each "
                    f"(export + import) = {100 * (h['share_of_short_ttft_p50'] or 0):.2f} % of the short "
                    "requests' TTFT p50")
    return "\n".join(rows)


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["co-located", "disaggregated"]
    entries = [summary["colocated"], summary["disaggregated"]]

    def pct(e, g, m, q):
        d = e[g][m]["percentiles"]
        return d.get(q, d.get(str(q)))

    panels = [("short TPOT p50 / p99 (ms)", [[pct(e, "main", "tpot_ms", 50) for e in entries],
                                            [pct(e, "main", "tpot_ms", 99) for e in entries]]),
              ("long-prompt TTFT p50 (s)", [[pct(e, "long", "ttft_ms", 50) / 1e3 for e in entries]]),
              ("output tok/s", [[e["all_output_throughput"] for e in entries]]),
              ("goodput (short req/s)", [[e["main"]["goodput"] for e in entries]])]
    fig, axes = plt.subplots(1, len(panels), figsize=(14, 3.4))
    for ax, (title, series) in zip(axes, panels):
        width = 0.8 / len(series)
        for i, values in enumerate(series):
            ax.bar([x + i * width for x in range(len(labels))], values, width,
                   color=["#4c72b0", "#dd8452"], alpha=1.0 - 0.4 * i)
        ax.set_xticks([x + (len(series) - 1) * width / 2 for x in range(len(labels))], labels)
        ax.set_title(title, fontsize=10)
    fig.suptitle("Disaggregated vs co-located serving, same engine and workload (2-core CPU)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


@click.command("disaggregated", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--engine", "engine_dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              required=True)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Where repositories, server logs, report.json and the plot go.")
@click.option("--chunk", type=int, default=16, show_default=True,
              help="prefill_chunk_size of both the co-located model and the context model.")
@click.option("--context-cpus", default="0", show_default=True)
@click.option("--generation-cpus", default="1", show_default=True)
@click.option("--threads", type=int, default=1, show_default=True,
              help="Kernel threads of the co-located engine (OMP_NUM_THREADS); the phase models get "
                   "one per pinned core.")
@click.option("--short-concurrency", type=int, default=8, show_default=True)
@click.option("--short-input-len", type=int, default=32, show_default=True)
@click.option("--short-output-len", type=int, default=24, show_default=True)
@click.option("--long-num", type=int, default=2, show_default=True)
@click.option("--long-input-len", type=int, default=2000, show_default=True)
@click.option("--long-start-s", type=float, default=15.0, show_default=True)
@click.option("--long-interval-s", type=float, default=90.0, show_default=True)
def disaggregated(engine_dir: Path, out: Path, chunk: int, context_cpus: str, generation_cpus: str,
                  threads: int, **o: Any) -> None:
    """Co-located (chunked prefill) vs disaggregated (context and generation on separate cores):
    one engine, one workload, one run; prints the comparison, writes OUT/report.json and a plot."""
    from trtforge.bench.serve import ServeBenchConfig
    from trtforge.bench.serve_report import machine
    from trtforge.model_repo.disaggregated import DisaggregatedOptions, PhaseOptions
    from trtforge.model_repo.emit import emit_repo

    out.mkdir(parents=True, exist_ok=True)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        click.echo(f"[{time.perf_counter() - t0:7.1f} s] {msg}", err=True)

    repos = {
        "colocated": emit_repo(engine_dir, out / "repo_colocated", prefill_chunk_size=chunk),
        "disaggregated": emit_repo(
            engine_dir, out / "repo_disaggregated", disaggregated=DisaggregatedOptions(
                context=PhaseOptions(scheduler={"prefill_chunk_size": chunk}, cpus=context_cpus),
                generation=PhaseOptions(cpus=generation_cpus))),
    }
    cfg = ServeBenchConfig(num_prompts=1000, input_len=o["short_input_len"], output_len=o["short_output_len"],
                           concurrency=o["short_concurrency"], long_num=o["long_num"],
                           long_input_len=o["long_input_len"], long_start_s=o["long_start_s"],
                           long_interval_s=o["long_interval_s"])
    runs = {label: run_one(label, repo, cfg, engine_dir, out, log) for label, repo in repos.items()}
    summary = summarize(runs)
    report = {"machine_start": machine(), "engine": str(engine_dir), "chunk": chunk, "threads": threads,
              "context_cpus": context_cpus, "generation_cpus": generation_cpus, "options": o,
              "summary": summary, "wall_s": time.perf_counter() - t0}
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    plot(summary, out / "disaggregated.png")
    click.echo(render(summary))
    log(f"report: {out / 'report.json'}, plot: {out / 'disaggregated.png'}")


if __name__ == "__main__":
    disaggregated()
