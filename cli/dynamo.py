"""`trtforge dynamo-worker`: an engine directory as an NVIDIA Dynamo backend worker (dynamo_backend/)."""

from __future__ import annotations

from typing import Any

import click

from trtforge.config.fields import dataclass_options, pick
from trtforge.config.runtime import RuntimeConfig
from trtforge.models.errors import BuildError
from trtforge.plugins.native import UnsafeCacheDir

RUNTIME_FIELDS = ("device", "kv_cache_memory", "cuda_graphs", "verify_checksums", "kv_connector",
                  "kv_advertise_host", "kv_auth_key_file", "kv_tls_cert_file", "kv_tls_key_file",
                  "kv_tls_ca_file", "kv_peers", "handoff_timeout_s")
"""The RuntimeConfig fields a Dynamo worker takes (the phase follows --disaggregation-mode)."""


def _worker_options(fn):
    from trtforge.dynamo_backend.options import WorkerOptions

    fn = dataclass_options(RuntimeConfig, only=RUNTIME_FIELDS)(fn)
    return dataclass_options(WorkerOptions, exclude=("engine_dir", "runtime", "scheduler"),
                             choices={"discovery_backend": ("file", "etcd", "mem", "kubernetes"),
                                      "request_plane": ("tcp", "nats"), "event_plane": ("zmq", "nats"),
                                      "disaggregation_mode": ("agg", "prefill", "decode")})(fn)


@click.command("dynamo-worker")
@click.argument("engine_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--schedule", multiple=True, metavar="KEY=VALUE", help="Override a scheduler parameter.")
@_worker_options
def dynamo_worker_command(engine_dir: str, schedule: tuple[str, ...], **options: Any) -> None:
    """Serve ENGINE_DIR as a Dynamo backend worker: start `python -m dynamo.frontend` beside it
    (docs/scale-out.md, "NVIDIA Dynamo"). Needs `pip install trtforge[dynamo]`."""
    from trtforge.cli.build import parse_schedule
    from trtforge.dynamo_backend.options import WorkerOptions

    try:
        import uvloop
        from dynamo.common.backend import Worker
    except ImportError as exc:
        raise click.ClickException(f"NVIDIA Dynamo is not installed ({exc}): pip install 'trtforge[dynamo]' "
                                   "&& pip install --no-deps ai-dynamo==1.6.1") from None
    from trtforge.dynamo_backend.worker import TrtforgeEngine

    try:
        opts = WorkerOptions(engine_dir=engine_dir, runtime=RuntimeConfig(**pick(RuntimeConfig, options)),
                             scheduler=parse_schedule(schedule), **pick(WorkerOptions, options))
        engine = TrtforgeEngine(opts)
        engine.load()
    except (ValueError, BuildError, UnsafeCacheDir) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"trtforge dynamo-worker: {engine.served_name} ({engine_dir}), model card {engine.card}", err=True)
    uvloop.run(Worker(engine, engine.worker_config()).run())
