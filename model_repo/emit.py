"""Write a Triton model repository for an engine directory (the interface of TensorRT-LLM's inflight_batcher_llm).

    REPO/
      ensemble/config.pbtxt      the interface TensorRT-LLM clients know (text_input, max_tokens,
                                 …, text_output); decoupled python model; its `parameters` are
                                 the engine dir and every prefill/decode scheduling option
      ensemble/1/model.py        trtforge's engine adapter (copied from this package)

The model named `ensemble` *is* the decoupled engine model: it takes text and returns text
deltas (tokenization and incremental detokenization run inside the runtime). We first emitted a
real Triton ensemble (platform "ensemble") with one step mapping onto an `llm` model; Triton
2.51 streams through it, but does not pass client cancellation on to the composing model: a
cancelled gRPC stream or a closed HTTP `/generate_stream` kept generating and holding KV blocks
until max_tokens. Served directly, the python model sees `is_cancelled()` for both and frees the
request's blocks at once. Clients see the same name, inputs and outputs either way.

Configs are typed protobuf (`model_config_pb2.ModelConfig`) written with `text_format`; nothing
is a template with placeholders.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from trtforge.config.fields import parse_bytes
from trtforge.model_repo import params as P
from trtforge.model_repo.interface import ENSEMBLE, INPUTS, OUTPUTS, TensorSpec

MODEL_PY = Path(__file__).parent / "python_models" / "engine.py"
"""The python-backend model, kept in the shape of the repository it is copied into."""


def _inputs(specs: tuple[TensorSpec, ...]) -> list[mc.ModelInput]:
    return [mc.ModelInput(name=s.name, data_type=mc.DataType.Value(s.dtype), dims=list(s.dims),
                          optional=s.optional) for s in specs]


def _outputs(specs: tuple[TensorSpec, ...]) -> list[mc.ModelOutput]:
    return [mc.ModelOutput(name=s.name, data_type=mc.DataType.Value(s.dtype), dims=list(s.dims))
            for s in specs]


def engine_model_config(parameters: dict[str, str], max_batch_size: int,
                        name: str = ENSEMBLE) -> mc.ModelConfig:
    """The decoupled python model that runs the engine. One instance: the engine batches;
    KIND_CPU because the python backend process itself needs no GPU (the engine picks its
    device from the `device` parameter)."""
    return mc.ModelConfig(
        name=name,
        backend="python",
        max_batch_size=max_batch_size,
        input=_inputs(INPUTS),
        output=_outputs(OUTPUTS),
        model_transaction_policy=mc.ModelTransactionPolicy(decoupled=True),
        instance_group=[mc.ModelInstanceGroup(kind=mc.ModelInstanceGroup.KIND_CPU, count=1)],
        parameters={k: mc.ModelParameter(string_value=v) for k, v in parameters.items()},
    )


def config_text(config: mc.ModelConfig, header: list[str] = ()) -> str:
    """config.pbtxt text: `#` comment lines (ignored by the parser) then the typed message."""
    lines = [f"# {h}".rstrip() for h in header]
    return "\n".join(lines + [text_format.MessageToString(config)])


def read_config(path: str | os.PathLike) -> mc.ModelConfig:
    """Parse a config.pbtxt back into a ModelConfig (raises text_format.ParseError)."""
    return text_format.Parse(Path(path).read_text(), mc.ModelConfig())


def _engine_json(engine_dir: Path) -> dict:
    path = engine_dir / "engine.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{engine_dir} is not an engine directory (no engine.json); build one with "
            "`build-engine CHECKPOINT --output ENGINE_DIR`."
        )
    return json.loads(path.read_text())


def scheduler_parameters(engine: dict, overrides: dict[str, Any]) -> dict[str, str]:
    """Every SchedulerConfig field: the engine's recorded defaults, then `overrides`; validated
    so that a bad value fails here rather than at model load."""
    P.check_unknown_overrides(overrides)
    given = {k: v for k, v in overrides.items() if v is not None}  # None: option not given
    # The runtime's own rule (the pool size is not known here: its default stands in for it);
    # ConfigError names the field, the value and the allowed range.
    config = P.scheduler_config_cls().for_engine(engine["build"], engine.get("scheduling", {}),
                                                 overrides=given)
    return {name: P.to_parameter(getattr(config, name)) for name in P.scheduler_parameter_names()}


def _checked_bytes(size: str | None) -> str:
    """kv_cache_memory as written by the user, after checking that it reads as a size."""
    if size is None or str(size).strip() == "":
        return ""
    try:
        parse_bytes(size)
    except ValueError as exc:  # its message says how to write a size
        raise ValueError(f"kv_cache_memory: {exc}") from None
    return str(size)


def _header(parameters: dict[str, str]) -> list[str]:
    docs = {**P.ADAPTER_PARAMETER_DOCS, **P.scheduler_field_docs()}
    lines = ["Written by `trtforge emit-repo`: the TensorRT-LLM `ensemble` interface, served by",
             "trtforge's engine (decoupled python model). Parameters:"]
    for name in parameters:
        lines.append(f"  {name}: {docs.get(name, '')}")
    return lines


def emit_repo(engine_dir: str | os.PathLike, repo_dir: str | os.PathLike, *,
              device: str = "cpu", triton_max_batch_size: int | None = None,
              exclude_input_in_output: bool = False, drain_timeout_s: float = 5.0,
              kv_cache_memory: str | None = None,
              trtllm_models_dir: str | os.PathLike | None = None, disaggregated: bool = False,
              context: Any = None, generation: Any = None, only: str | None = None,
              context_urls: str = "", generation_urls: str = "", **scheduler_overrides: Any) -> Path:
    """Write (or replace) the `ensemble` model of `repo_dir` for `engine_dir`.

    `scheduler_overrides` are SchedulerConfig fields (e.g. `max_batch_size=8`); they are validated
    here and written, with every other scheduling parameter, into ensemble/config.pbtxt. Other models
    already in `repo_dir` are left alone. Returns the repository path.

    disaggregated: write `context` and `generation` models and a router `ensemble` instead
    (model_repo/disaggregated.py); `context` / `generation` are their PhaseOptions.
    """
    engine_dir = Path(engine_dir).resolve()
    engine = _engine_json(engine_dir)
    if engine.get("backend") == "trtllm":  # served by Triton's tensorrtllm backend (model_repo/trtllm)
        from trtforge.model_repo.trtllm.emit import emit_trtllm_repo  # noqa: PLC0415

        return emit_trtllm_repo(engine_dir, repo_dir, engine, device=device,
                                triton_max_batch_size=triton_max_batch_size,
                                exclude_input_in_output=exclude_input_in_output,
                                kv_cache_memory=kv_cache_memory, models_dir=trtllm_models_dir,
                                disaggregated=disaggregated, **scheduler_overrides)
    if trtllm_models_dir is not None:
        raise ValueError(f"--trtllm-models-dir is for engines built with --backend trtllm; "
                         f"{engine_dir} has backend {engine.get('backend', 'torch')!r}.")
    if triton_max_batch_size is None:  # the batch dimension clients send; one prompt each
        triton_max_batch_size = int(engine.get("build", {}).get("max_batch_size", 64))
    if disaggregated:
        from trtforge.model_repo.disaggregated import PhaseOptions, emit_disaggregated  # noqa: PLC0415

        if scheduler_overrides or kv_cache_memory:
            raise ValueError("with --disaggregated, scheduling options and the KV memory are each "
                             "phase's own: use --context-… / --generation-… options (e.g. "
                             "--context-prefill-chunk-size, --generation-max-batch-size, "
                             "--context-kv-cache-memory)")
        return emit_disaggregated(engine_dir, Path(repo_dir), engine, device=device,
                                  triton_max_batch_size=triton_max_batch_size,
                                  exclude_input_in_output=exclude_input_in_output,
                                  drain_timeout_s=drain_timeout_s,
                                  context=context or PhaseOptions(),
                                  generation=generation or PhaseOptions(), only=only,
                                  context_urls=context_urls, generation_urls=generation_urls)
    parameters = {
        P.ENGINE_DIR: str(engine_dir),
        P.DEVICE: device,
        P.EXCLUDE_INPUT_DEFAULT: P.to_parameter(exclude_input_in_output),
        P.KV_CACHE_MEMORY: _checked_bytes(kv_cache_memory),
        P.DRAIN_TIMEOUT: P.to_parameter(drain_timeout_s),
        **scheduler_parameters(engine, scheduler_overrides),
    }
    repo = Path(repo_dir)
    repo.mkdir(parents=True, exist_ok=True)
    text = config_text(engine_model_config(parameters, triton_max_batch_size),
                       _header(parameters))
    _write_model(repo, ENSEMBLE, text, {"model.py": MODEL_PY})
    return repo


def _write_model(repo: Path, name: str, config: str, files: dict[str, Path]) -> None:
    """Build the model directory beside its final place, then swap it in (never half-written)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=repo))
    try:
        (tmp / "1").mkdir()
        (tmp / "config.pbtxt").write_text(config + "\n")
        for dest, src in files.items():
            (tmp / "1" / dest).parent.mkdir(parents=True, exist_ok=True)  # e.g. lib/decode.py
            shutil.copyfile(src, tmp / "1" / dest)
        target = repo / name
        if target.exists():
            shutil.rmtree(target)
        tmp.chmod(0o755)  # mkdtemp makes it private; the server may run as another user
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def engine_parameters(config: mc.ModelConfig) -> dict[str, str]:
    """{name: string_value} of a model config's parameters."""
    return {k: v.string_value for k, v in config.parameters.items()}


__all__ = ["emit_repo", "read_config", "engine_model_config", "INPUTS", "OUTPUTS", "ENSEMBLE",
           "TensorSpec", "engine_parameters"]
