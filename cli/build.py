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


def _trtllm_repo_option(fn):
    """--trtllm-repo: TrtllmOptions.repo (model_repo/trtllm/options.py), whose doc is the help."""
    from trtforge.config.fields import field_docs
    from trtforge.model_repo.trtllm.options import REPO_KINDS, TrtllmOptions

    return click.option(
        "--trtllm-repo", type=click.Choice(REPO_KINDS), default=None, show_default=False,
        help=f"With --backend trtllm and --triton-repo, the TensorRT-LLM repository kind: "
             f"{field_docs(TrtllmOptions)['repo']} llmapi builds no engine (no --output): it writes "
             f"just the --triton-repo for CHECKPOINT; `trtforge emit-repo --trtllm-repo llmapi` takes "
             f"its release and drift options. [default: {TrtllmOptions.repo}]")(fn)


@click.command("build", context_settings={"show_default": True})
@click.argument("checkpoint")
@click.option("--output", "-o", type=click.Path(file_okay=False), default=None,
              help="Engine directory to write (required unless --trtllm-repo llmapi).")
@click.option("--force", is_flag=True, help="Replace an existing output directory.")
@click.option("--triton-repo", type=click.Path(file_okay=False), default=None,
              help="Also write a Triton model repository serving the engine here.")
@_trtllm_repo_option
@click.option("--disaggregated", is_flag=True,
              help="With --triton-repo: separate context (prefill) and generation (decode) models "
                   "behind the ensemble (tune them with `trtforge emit-repo --disaggregated`).")
@click.option("--schedule", multiple=True, metavar="KEY=VALUE",
              help="Default scheduler parameter stored in engine.json (see `trtforge emit-repo --help`).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or report.")
@dataclass_options(BuildConfig, choices={"backend": BACKENDS, "quantization": QUANTIZATIONS,
                                         "kv_cache_dtype": KV_CACHE_DTYPES})
def build_engine(checkpoint: str, output: str | None, force: bool, triton_repo: str | None,
                 trtllm_repo: str | None, disaggregated: bool, schedule: tuple[str, ...], quiet: bool,
                 **options: Any) -> None:
    """Convert a Hugging Face CHECKPOINT (local directory or hub id) into a trtforge engine.

    With --backend trtllm --trtllm-repo llmapi, nothing is built: --triton-repo gets TensorRT-LLM's
    LLM-API model, which loads CHECKPOINT when Triton starts (docs/tensorrt-llm.md)."""
    from trtforge.builder.build import build_engine as run_build

    if disaggregated and not triton_repo:
        raise click.UsageError("--disaggregated describes the Triton repository: give --triton-repo too")
    try:
        build = BuildConfig(**pick(BuildConfig, options))
        build.check_quantization_options()  # before a backend hook looks for TensorRT
        build.check_kv_cache_dtype()
        build.check_tp_options()
        build.speculative()  # a bad --speculative-config fails here, before any work
        scheduling = _validated_schedule(parse_schedule(schedule), build)
        if _check_trtllm_repo(trtllm_repo, build, output, force, triton_repo, disaggregated):
            _emit_llmapi(checkpoint, triton_repo, build, scheduling)
            return
        if output is None:
            raise click.UsageError("Missing option '--output' / '-o'.")
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


def _check_trtllm_repo(trtllm_repo: str | None, build: BuildConfig, output: str | None, force: bool,
                       triton_repo: str | None, disaggregated: bool) -> bool:
    """Whether this is an llmapi run (no engine build); UsageError for options that contradict it."""
    if trtllm_repo is None:
        return False
    if build.backend != "trtllm":
        raise click.UsageError(f"--trtllm-repo is for --backend trtllm (here: --backend {build.backend})")
    if not triton_repo:
        what = "writes only" if trtllm_repo == "llmapi" else "describes"
        raise click.UsageError(f"--trtllm-repo {trtllm_repo} {what} a Triton repository: give --triton-repo")
    if trtllm_repo != "llmapi":
        return False
    given = [flag for flag, value in (("--output", output), ("--force", force),
                                      ("--disaggregated", disaggregated)) if value]
    if given:
        raise click.UsageError(f"{', '.join(given)}: --trtllm-repo llmapi builds no engine (TensorRT-LLM loads "
                               "CHECKPOINT when Triton starts) and has no disaggregated layout")
    return True


def _emit_llmapi(checkpoint: str, repo: str, build: BuildConfig, scheduling: dict[str, Any]) -> None:
    """TensorRT-LLM's LLM-API repository for `checkpoint`, with the build and --schedule options."""
    from trtforge.model_repo.trtllm.emit_llmapi import emit_llmapi_repo

    try:
        path = emit_llmapi_repo(checkpoint, repo, build=build, **scheduling)
    except (ValueError, FileNotFoundError) as exc:  # drift, a models dir that is not there
        raise click.ClickException(str(exc)) from None
    click.echo(f"TensorRT-LLM LLM-API repository written to {path} (no engine built: TensorRT-LLM loads "
               f"{checkpoint} when Triton starts)")


def _emit_repo(engine_dir: str, repo: str, disaggregated: bool = False) -> None:
    from trtforge.model_repo.emit import emit_repo

    try:
        path = emit_repo(engine_dir, repo, disaggregated=disaggregated)
    except (ValueError, FileNotFoundError) as exc:  # drift, a models dir that is not there
        raise click.ClickException(f"the engine is in {engine_dir}, but its Triton repository was not "
                                   f"written: {exc}") from None
    click.echo(f"Triton model repository written to {path}")


def main() -> None:  # pragma: no cover - console script shim
    build_engine(prog_name="build-engine")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
