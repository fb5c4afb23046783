"""`trtforge bench soak` (the Click command; the soak runs in soak.py, imported when it runs)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import click

from trtforge.bench.soak_config import SoakConfig
from trtforge.config.fields import dataclass_options, pick


@click.command("soak", context_settings={"help_option_names": ["-h", "--help"]})
@dataclass_options(SoakConfig)
@click.option("--server-env", "server_env", multiple=True, metavar="KEY=VALUE",
              help="Environment variable for tritonserver and its stubs (repeatable), e.g. MALLOC_ARENA_MAX=2.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the report as JSON here.")
def soak(server_env: tuple[str, ...], json_path: str | None, **options: Any) -> None:
    """Soak a real tritonserver on loopback with good, cancelled and malformed requests; check the
    answers, and read the server's memory and engine gauges as requests accumulate."""
    cfg = dataclasses.replace(SoakConfig(), **pick(SoakConfig, options))
    cfg.validate()
    bad = [e for e in server_env if "=" not in e]
    if bad:
        raise click.BadParameter(f"{bad[0]!r}: expected KEY=VALUE", param_hint="--server-env")
    env = dict(e.split("=", 1) for e in server_env)
    from trtforge.bench import soak_report as R  # numpy, tritonclient: only when it runs
    from trtforge.bench.soak import run_soak

    report = run_soak(cfg, env)
    click.echo(R.format_text(report))
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1))
        click.echo(f"JSON report: {json_path}")
    if not report["passed"]:
        sys.exit(1)


if __name__ == "__main__":
    soak()
