"""Write a Triton model repository for an engine directory (the interface of TensorRT-LLM's inflight_batcher_llm).

    REPO/
      ensemble/config.pbtxt      the interface TensorRT-LLM clients know (text_input, max_tokens,
                                 …, text_output); decoupled python model; its `parameters` are
                                 the engine dir, the runtime options (device, KV memory,
                                 speculative_config) and every prefill/decode scheduling option
      ensemble/1/model.py        trtforge's engine adapter (python_models/engine.py)

The model named `ensemble` *is* the decoupled engine model: it takes text and returns text
deltas (tokenization and incremental detokenization run inside the runtime). We first emitted a
real Triton ensemble (platform "ensemble") with one step mapping onto an `llm` model; Triton
2.51 streams through it, but does not pass client cancellation on to the composing model: a
cancelled gRPC stream or a closed HTTP `/generate_stream` kept generating and holding KV blocks
until max_tokens. Served directly, the python model sees `is_cancelled()` for both and frees the
request's blocks at once. Clients see the same name, inputs and outputs either way.

Engines built with `--backend trtllm` get TensorRT-LLM's own repository instead (trtllm/emit.py),
and TrtllmOptions(repo="llmapi") writes TensorRT-LLM's LLM-API repository for a Hugging Face checkpoint,
with no engine at all (trtllm/emit_llmapi.py);
`disaggregated` writes context, generation and a router (disaggregated.py). The config messages
and model directories are written by pbtxt.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from trtforge.config.runtime import RuntimeConfig
from trtforge.config.speculative import SpeculativeConfig, unsupported as speculation_unsupported
from trtforge.model_repo.disaggregated import (
    DisaggregatedOptions,
    WorkerRouterOptions,
    emit_disaggregated,
    emit_worker_router,
)
from trtforge.model_repo.interface import ENSEMBLE
from trtforge.model_repo.params import (
    SPECULATIVE_CONFIG,
    AdapterOptions,
    parameter_docs,
    runtime_parameters,
    scheduler_parameters,
)
from trtforge.model_repo.pbtxt import config_text, python_model_config, write_model
from trtforge.model_repo.python_models import ENGINE_PY
from trtforge.model_repo.trtllm.emit import emit_trtllm_repo
from trtforge.model_repo.trtllm.values import TrtllmOptions
from trtforge.models.engine_dir import ENGINE_JSON, EngineConfig, read_engine_config


def read_engine(engine_dir: Path) -> EngineConfig:
    """engine.json (its metadata: the emitter reads no weights, so checksums are not checked)."""
    if not (engine_dir / ENGINE_JSON).is_file():
        raise FileNotFoundError(
            f"{engine_dir} is not an engine directory (no {ENGINE_JSON}); build one with "
            "`build-engine CHECKPOINT --output ENGINE_DIR`."
        )
    return read_engine_config(engine_dir, verify_checksums=False)


def _header(parameters: dict[str, str]) -> list[str]:
    docs = parameter_docs()
    lines = ["Written by `trtforge emit-repo`: the TensorRT-LLM `ensemble` interface, served by",
             "trtforge's engine (decoupled python model). Parameters:"]
    for name in parameters:
        lines.append(f"  {name}: {docs.get(name, '')}")
    return lines


def emit_repo(engine_dir: str | os.PathLike, repo_dir: str | os.PathLike, *,
              device: str = RuntimeConfig.device, triton_max_batch_size: int | None = None,
              exclude_input_in_output: bool = AdapterOptions.exclude_input_in_output,
              kv_events_endpoint: str = AdapterOptions.kv_events_endpoint,
              kv_cache_memory: str | None = None,
              trtllm_models_dir: str | os.PathLike | TrtllmOptions | None = None,
              disaggregated: bool | DisaggregatedOptions | WorkerRouterOptions = False,
              **overrides: Any) -> Path:
    """Write (or replace) the `ensemble` model of `repo_dir` for `engine_dir`.

    `overrides` are SchedulerConfig fields (e.g. `max_batch_size=8`); they are validated here and
    written, with every other scheduling parameter, into ensemble/config.pbtxt. Other models
    already in `repo_dir` are left alone. Returns the repository path.

    Among them, `speculative_config` (the RuntimeConfig field: vLLM's JSON object, or "none": no
    speculation) is the engine model's speculative_config parameter; not given: engine.json's
    default. Refused, by name, for the repository kinds where trtforge's speculation cannot run
    (TensorRT-LLM's, disaggregated, a router over workers).

    disaggregated: write `context` and `generation` models and a router `ensemble` instead
    (model_repo/disaggregated.py), with their DisaggregatedOptions (True: the defaults).

    A WorkerRouterOptions instead: write only a router `ensemble` over co-located worker servers
    (each serving a plain repository of this engine; disaggregated.py emit_worker_router).

    trtllm_models_dir: for TensorRT-LLM (docs/tensorrt-llm.md), the image's
    all_models/inflight_batcher_llm, or a TrtllmOptions holding it and the choices of repository
    (repo="llmapi": engine_dir is then a Hugging Face checkpoint or hub id), release (version) and
    drift override (allow_drift; without it, a difference raises TrtllmDrift).
    """
    speculative_config = overrides.pop(SPECULATIVE_CONFIG, None)
    scheduler_overrides = overrides
    trtllm = (trtllm_models_dir if isinstance(trtllm_models_dir, TrtllmOptions)
              else TrtllmOptions(models_dir=trtllm_models_dir))
    if trtllm.repo == "llmapi":
        return _emit_llmapi(engine_dir, repo_dir, trtllm, disaggregated, kv_cache_memory, scheduler_overrides,
                            speculative_config)
    engine_dir = Path(engine_dir).resolve()
    engine = read_engine(engine_dir)
    _refuse_speculation(speculative_config, engine, disaggregated)
    if isinstance(disaggregated, WorkerRouterOptions):
        return _emit_worker_router(engine_dir, engine, Path(repo_dir), disaggregated, triton_max_batch_size,
                                   exclude_input_in_output, {"kv_cache_memory": kv_cache_memory,
                                                             "kv_events_endpoint": kv_events_endpoint,
                                                             "speculative_config": speculative_config,
                                                             **scheduler_overrides})
    if kv_events_endpoint and engine.backend == "trtllm":
        raise ValueError("--kv-events-endpoint: TensorRT-LLM's tensorrtllm backend publishes its own KV events "
                         "(its executor's event API), not through trtforge's model")
    if engine.backend == "trtllm":  # served by Triton's tensorrtllm backend (model_repo/trtllm)
        return emit_trtllm_repo(engine_dir, repo_dir, engine, device=device,
                                triton_max_batch_size=triton_max_batch_size,
                                exclude_input_in_output=exclude_input_in_output,
                                kv_cache_memory=kv_cache_memory, disaggregated=bool(disaggregated),
                                trtllm=trtllm, **scheduler_overrides)
    if (trtllm.version, trtllm.allow_drift) != (None, None):
        raise ValueError(f"TensorRT-LLM options are for engines built with --backend trtllm; {engine_dir} "
                         f"has backend {engine.backend!r}.")
    if trtllm.models_dir is not None:
        raise ValueError(f"--trtllm-models-dir is for engines built with --backend trtllm; "
                         f"{engine_dir} has backend {engine.backend!r}.")
    if triton_max_batch_size is None:  # the batch dimension clients send; one prompt each
        triton_max_batch_size = int(engine.build.get("max_batch_size", 64))
    adapter = AdapterOptions(engine_dir=str(engine_dir), exclude_input_in_output=exclude_input_in_output,
                             kv_events_endpoint=kv_events_endpoint)
    if disaggregated and kv_events_endpoint:
        raise ValueError("--kv-events-endpoint is for a co-located repository (one engine model with one "
                         "prefix cache); not with --disaggregated")
    if disaggregated:
        if scheduler_overrides or kv_cache_memory:
            raise ValueError("with --disaggregated, scheduling options and the KV memory are each "
                             "phase's own: use --context-… / --generation-… options (e.g. "
                             "--context-prefill-chunk-size, --generation-max-batch-size, "
                             "--context-kv-cache-memory)")
        options = disaggregated if isinstance(disaggregated, DisaggregatedOptions) else DisaggregatedOptions()
        return emit_disaggregated(engine, Path(repo_dir), adapter, options, device=device,
                                  triton_max_batch_size=triton_max_batch_size)
    parameters = {
        **adapter.parameters(),
        **runtime_parameters(device=device, kv_cache_memory=kv_cache_memory,
                             speculative_config=_speculation(engine, speculative_config)),
        **scheduler_parameters(engine, scheduler_overrides),
    }
    repo = Path(repo_dir)
    repo.mkdir(parents=True, exist_ok=True)
    text = config_text(python_model_config(ENSEMBLE, parameters, triton_max_batch_size),
                       _header(parameters))
    write_model(repo, ENSEMBLE, text, {"model.py": ENGINE_PY})
    return repo


def _refuse_speculation(given: str | None, engine: EngineConfig, disaggregated: Any) -> None:
    """A speculative_config given for a repository kind it cannot apply to is refused by name."""
    if given in (None, "") or isinstance(disaggregated, WorkerRouterOptions):
        return  # a router's: refused with the other engine options it has no place for (_emit_worker_router)
    if engine.backend == "trtllm":
        raise ValueError(f"--speculative-config: a --backend trtllm engine is served by TensorRT-LLM's tensorrtllm "
                         f"backend, not trtforge's engine model: {speculation_unsupported('trtllm')}")
    if disaggregated:
        raise ValueError("--speculative-config: not with --disaggregated (the context model computes one token, "
                         "and the router does not pass speculation outputs on); the generation model runs "
                         "engine.json's default speculative_config, if the engine has one")


def _speculation(engine: EngineConfig, given: str | None) -> SpeculativeConfig | str | None:
    """The engine model's speculative_config parameter: `given` (checked against the engine), else
    engine.json's default (None: none)."""
    if given in (None, ""):
        return None if engine.speculative_config is None else SpeculativeConfig.parse(engine.speculative_config)
    spec = RuntimeConfig(speculative_config=given).speculation()  # ValueError naming a bad field
    why = None if spec is None else speculation_unsupported(engine.backend, engine.tp_size)
    if why is not None:
        raise ValueError(f"--speculative-config ({spec.method}): speculative decoding is not supported with {why}")
    return given


def _emit_worker_router(engine_dir: Path, engine: EngineConfig, repo: Path, options: WorkerRouterOptions,
                        triton_max_batch_size: int | None, exclude_input_in_output: bool,
                        engine_options: dict[str, Any]) -> Path:
    """A router over co-located workers; `engine_options` given (not None, not empty) are refused."""
    given = ["--" + k.replace("_", "-") for k, v in engine_options.items() if v not in (None, "")]
    if given:
        raise ValueError(f"{', '.join(given)}: not options of a router over co-located workers (it runs "
                         "no engine); give them to the workers' own `emit-repo ENGINE REPO`")
    if engine.backend == "trtllm":
        raise ValueError("--only router --worker-url: trtforge's router forwards to trtforge engine models; "
                         "a --backend trtllm engine is served by Triton's tensorrtllm backend")
    adapter = AdapterOptions(engine_dir=str(engine_dir), exclude_input_in_output=exclude_input_in_output)
    batch = triton_max_batch_size or int(engine.build.get("max_batch_size", 64))
    return emit_worker_router(engine, repo, adapter, options, triton_max_batch_size=batch)


def _emit_llmapi(checkpoint: str | os.PathLike, repo_dir: str | os.PathLike, trtllm: TrtllmOptions,
                 disaggregated: Any, kv_cache_memory: str | None, scheduler_overrides: dict[str, Any],
                 speculative_config: str | None) -> Path:
    """The LLM-API repository: `checkpoint` is what TensorRT-LLM loads, not an engine directory."""
    from trtforge.builder.build_config import BuildConfig
    from trtforge.model_repo.trtllm.emit_llmapi import emit_llmapi_repo  # reads checkpoints (builder)

    if speculative_config not in (None, ""):
        raise ValueError("--speculative-config: not an option of the llmapi repository (TensorRT-LLM's LLM API "
                         "takes its own speculative_config in model.yaml, which trtforge does not write)")

    if (Path(checkpoint) / ENGINE_JSON).is_file():
        raise ValueError(f"{checkpoint} is an engine directory; the llmapi repository serves a Hugging Face "
                         "checkpoint with TensorRT-LLM's PyTorch backend: pass the checkpoint (or its hub id)")
    if disaggregated:
        raise ValueError("the llmapi repository has no disaggregated layout in trtforge; write the "
                         "inflight_batcher_llm repository of a --backend trtllm engine instead")
    build = BuildConfig(backend="trtllm", **({"kv_cache_memory": kv_cache_memory} if kv_cache_memory else {}))
    return emit_llmapi_repo(checkpoint, repo_dir, build=build, trtllm=trtllm, **scheduler_overrides)
