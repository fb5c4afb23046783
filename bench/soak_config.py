"""Options of `trtforge bench soak`, apart from the soak itself so that registering the command
imports nothing heavy (`trtforge --help` stays fast)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import click


@dataclass
class SoakConfig:
    """Options of `trtforge bench soak` (the CLI reads its defaults and help from here)."""

    work_dir: str | None = None
    """Where the demo checkpoint, engine, repository and server log go (reused across runs).
    Default: $TMPDIR/trtforge-soak."""
    num_requests: int = 10_000
    """Requests to send."""
    concurrency: int = 24
    """Requests in flight at once."""
    checkpoints: str = "1000,5000,10000"
    """Request counts after which sending pauses, the server goes idle and its memory is read
    (comma-separated; the end of the run is always one)."""
    seed: int = 0
    """Seed of the request plan."""
    max_seconds: float = 3600.0
    """Stop sending new requests after this long (the report says how many were sent)."""
    request_timeout_s: float = 60.0
    """A request with no complete answer for this long counts as an error (and is cut)."""
    idle_timeout_s: float = 30.0
    """How long a checkpoint waits for the gauges to reach 0."""
    model_file: str | None = None
    """Serve this model.py instead of the packaged one (e.g. an instrumented copy)."""
    rebuild: bool = False
    """Rebuild the demo engine even if --work-dir has one."""

    def validate(self) -> None:
        for name in ("num_requests", "concurrency", "max_seconds", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise click.BadParameter("must be > 0", param_hint="--" + name.replace("_", "-"))
        try:
            self.checkpoint_list()
        except ValueError:
            raise click.BadParameter(f"{self.checkpoints!r}: expected counts like 1000,5000",
                                     param_hint="--checkpoints") from None

    def checkpoint_list(self) -> list[int]:
        marks = {int(x) for x in self.checkpoints.split(",") if x.strip()}
        return sorted({m for m in marks if 0 < m < self.num_requests} | {self.num_requests})

    def work_path(self) -> Path:
        return Path(self.work_dir or Path(tempfile.gettempdir()) / "trtforge-soak")
