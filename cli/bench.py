"""`trtforge bench ...`: benchmark scripts with reports (the `bench` Click group)."""

from __future__ import annotations

import dataclasses
import time

import click

from trtforge.bench.offline_config import OfflineBenchConfig
from trtforge.config.fields import dataclass_options, pick


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def bench() -> None:
    """Benchmarks: print a table, write JSON (and PNG); baselines measured in the same run."""


@bench.command("offline")
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False))
@click.argument("engine_dir", type=click.Path(exists=True, file_okay=False))
@dataclass_options(OfflineBenchConfig)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the report as JSON here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False),
              help="Write the TTFT-vs-decode plot (PNG) here; needs matplotlib.")
def offline(checkpoint: str, engine_dir: str, json_path: str | None, plot_path: str | None, **options) -> None:
    """Offline throughput: HF generate one at a time (a) and in static batches (b) against
    trtforge in-flight batching (c), plus TTFT/decode, KV waste and the decode bandwidth bound.

    CHECKPOINT is the Hugging Face checkpoint the baselines load; ENGINE_DIR the engine built from
    it (`build-engine CHECKPOINT -o ENGINE_DIR --dtype float32`)."""
    from trtforge.bench.offline import run_offline
    from trtforge.bench.offline_report import plot_seed_experiment, render, write_json

    cfg = dataclasses.replace(OfflineBenchConfig(), **pick(OfflineBenchConfig, options))
    try:
        cfg.prompt_lens()
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--seed-prompt-lens") from None
    start = time.perf_counter()
    report = run_offline(checkpoint, engine_dir, cfg, log=lambda msg: click.echo(msg, err=True))
    report["wall_s"] = time.perf_counter() - start
    click.echo(render(report))
    if json_path:
        write_json(report, json_path)
        click.echo(f"JSON report: {json_path}")
    if plot_path:
        plot_seed_experiment(report, plot_path)
        click.echo(f"plot: {plot_path}")


def _add_serving_commands() -> None:
    """The serving benchmarks' commands live beside their code (bench/serve.py, bench/disagg_report.py;
    the soak's in cli/bench_soak.py); importing them loads no torch."""
    from trtforge.bench.disagg_report import disaggregated
    from trtforge.bench.serve import serve
    from trtforge.cli.bench_soak import soak

    for cmd in (serve, soak, disaggregated):
        bench.add_command(cmd)


_add_serving_commands()
