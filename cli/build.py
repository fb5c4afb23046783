"""`build-engine` (also `trtforge build`): the Click front of builder/build.py.

Options come from `BuildConfig` (defaults and help written once, in the dataclass).
"""

from __future__ import annotations

import sys
from typing import Any

import click

from trtforge.builder.build_config import BACKENDS, KV_CACHE_DTYPES, QUANTIZATIONS, BuildConfig
from trtforge.config.fields import dataclass_options, pick
from trtforge.models.errors import BuildError


def parse_schedule(items: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise BuildError(f"--schedule {item!r} must look like KEY=VALUE (e.g. prefill_chunk_size=512).")
        out[key.strip().replace("-", "_")] = value.strip()
    return out


def _backend_hook(build: BuildConfig, checkpoint: str) -> Any:
    if build.backend == "trtllm":
        from trtforge.builder.trtllm.build import trtllm_hook

        return trtllm_hook(checkpoint, build)  # fails before converting anything without TensorRT-LLM
    if build.backend == "tensorrt":
        from trtforge.builder.tensorrt.build import build_tensorrt, require_tensorrt

        require_tensorrt()  # fail before converting anything when TensorRT or the GPU is missing
        return build_tensorrt
    return None


@click.command("build", context_settings={"show_default": True})
@click.argument("checkpoint")
@click.option("--output", "-o", required=True, type=click.Path(file_okay=False), help="Engine directory to write.")
@click.option("--force", is_flag=True, help="Replace an existing output directory.")
@click.option("--triton-repo", type=click.Path(file_okay=False), default=None,
              help="Also write a Triton model repository serving the engine here.")
@click.option("--disaggregated", is_flag=True,
              help="With --triton-repo: separate context (prefill) and generation (decode) models "
                   "behind the ensemble (tune them with `trtforge emit-repo --disaggregated`).")
@click.option("--schedule", multiple=True, metavar="KEY=VALUE",
              help="Default scheduler parameter stored in engine.json (see `trtforge emit-repo --help`).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or report.")
@dataclass_options(BuildConfig, choices={"backend": BACKENDS, "quantization": QUANTIZATIONS,
                                         "kv_cache_dtype": KV_CACHE_DTYPES})
def build_engine(checkpoint: str, output: str, force: bool, triton_repo: str | None,
                 disaggregated: bool, schedule: tuple[str, ...], quiet: bool, **options: Any) -> None:
    """Convert a Hugging Face CHECKPOINT (local directory or hub id) into a trtforge engine."""
    from trtforge.builder.build import build_engine as run_build

    if disaggregated and not triton_repo:
        raise click.UsageError("--disaggregated describes the Triton repository: give --triton-repo too")
    try:
        build = BuildConfig(**pick(BuildConfig, options))
        build.check_quantization_options()  # before a backend hook looks for TensorRT
        build.check_kv_cache_dtype()
        build.check_tp_options()
        scheduling = _validated_schedule(parse_schedule(schedule), build)
        out, cfg = run_build(checkpoint, output, build, force=force, scheduling=scheduling,
                             progress=not quiet, on_tmp_dir=_backend_hook(build, checkpoint))
    except BuildError as exc:
        raise click.ClickException(str(exc)) from None
    if not quiet:
        from trtforge.builder.report import BuildReport

        quant = f", {cfg.quantization['scheme']}" if cfg.quantization else ""
        click.echo(f"engine written to {out} ({cfg.model.architecture}, {cfg.dtype}{quant}, backend {cfg.backend})")
        for line in BuildReport(**cfg.report).lines():
            click.echo("  " + line)
    if triton_repo:
        _emit_repo(str(out), triton_repo, disaggregated)


def _validated_schedule(values: dict[str, Any], build: BuildConfig) -> dict[str, Any]:
    """Check --schedule values now rather than when a server loads the engine."""
    if not values:
        return values
    try:
        from trtforge.config.scheduler import ConfigError, SchedulerConfig
    except ImportError:  # serving not installed: the runtime validates at load
        return values
    try:
        SchedulerConfig.refuse_engine_fields(values)  # the build options set those (--max-seq-len, ...)
        return SchedulerConfig.coerce(values)
    except (ConfigError, ValueError) as exc:
        raise BuildError(f"--schedule: {exc}") from None


def _emit_repo(engine_dir: str, repo: str, disaggregated: bool = False) -> None:
    from trtforge.model_repo.emit import emit_repo

    path = emit_repo(engine_dir, repo, disaggregated=disaggregated)
    click.echo(f"Triton model repository written to {path}")


def main() -> None:  # pragma: no cover - console script shim
    build_engine(prog_name="build-engine")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
