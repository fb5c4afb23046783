"""Write a disaggregated repository: `ensemble` (the router) → `context` (prefill) → `generation` (decode).

    REPO/
      ensemble/config.pbtxt     the interface clients know; role disaggregated_serving_bls
      ensemble/1/model.py       the router (model_repo/router/1/model.py)
      context/config.pbtxt      prefill parameters only; request_type, context_phase_params in/out
      context/1/model.py        the engine model (model_repo/ensemble/1/model.py), phase context
      generation/config.pbtxt   decode parameters only
      generation/1/model.py     the engine model, phase generation

The router takes the name `ensemble` itself instead of sitting behind it (TensorRT-LLM routes
ensemble → disaggregated_serving_bls): a Triton ensemble in front does not pass client
cancellation on (see emit.py), and a forwarding python model would add one IPC hop per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from trtforge.model_repo import params as P
from trtforge.model_repo import phases as D
from trtforge.model_repo.emit import (MODEL_PY, _checked_bytes, _inputs, _outputs, _write_model, config_text,
                   engine_model_config, scheduler_parameters)
from trtforge.model_repo.interface import ENSEMBLE, INPUTS, OUTPUTS, PHASE_INPUTS, PHASE_OUTPUTS

ROUTER_PY = Path(__file__).parent / "python_models" / "router.py"


@dataclass
class PhaseOptions:
    """What `emit-repo --disaggregated` sets for one phase model (the CLI's --context-* /
    --generation-* options)."""

    scheduler: dict[str, Any] = field(default_factory=dict)
    """SchedulerConfig fields of this phase (others are refused)."""
    kv_cache_memory: str | None = None
    cpus: str = ""
    cpu_threads: int | None = None
    instances: int = 1
    handoff_timeout_s: float | None = None
    """Context only."""
    kv_connector: str | None = None
    """Context only: shm | tcp://HOST:PORT."""
    kv_advertise_host: str | None = None
    """Context only: where generation servers reach the tcp connector."""


def emit_disaggregated(engine_dir: Path, repo: Path, engine: dict, *, device: str,
                       triton_max_batch_size: int, exclude_input_in_output: bool,
                       drain_timeout_s: float, context: PhaseOptions,
                       generation: PhaseOptions, only: str | None = None,
                       context_urls: str = "", generation_urls: str = "") -> Path:
    """only: write just one of the three models (context | generation | router), for servers on
    different hosts; the router then reaches the others at context_urls / generation_urls."""
    if only not in (None, D.CONTEXT, D.GENERATION, "router"):
        raise ValueError(f"only={only!r} is invalid: must be context, generation or router")
    if (context_urls or generation_urls) and only != "router":
        raise ValueError("--context-url / --generation-url are for a router on its own server: add --only router")
    if only == "router" and not (context_urls and generation_urls):
        raise ValueError("--only router needs --context-url and --generation-url (the servers it routes to)")
    phases = tuple((p, o) for p, o in ((D.CONTEXT, context), (D.GENERATION, generation))
                   if only in (None, p))
    for phase, opts in phases:  # every check before anything is written
        D.refuse_other_phase(phase, [k for k, v in opts.scheduler.items() if v is not None])
        if phase == D.GENERATION and (opts.handoff_timeout_s is not None or opts.kv_connector):
            D.refuse_other_phase(phase, [D.HANDOFF_TIMEOUT if opts.handoff_timeout_s is not None
                                         else D.KV_CONNECTOR])
        if opts.kv_connector and opts.kv_connector != "shm":
            from trtforge.serving.kv_connector.tcp import parse_address  # noqa: PLC0415

            parse_address(opts.kv_connector)
        D.parse_cpus(opts.cpus)
        if opts.instances < 1:
            raise ValueError(f"{phase} instances={opts.instances} is invalid: must be >= 1")
        scheduler_parameters(engine, opts.scheduler)
        _checked_bytes(opts.kv_cache_memory)
    repo.mkdir(parents=True, exist_ok=True)
    for phase, opts in phases:
        params = {
            P.ENGINE_DIR: str(engine_dir),
            P.DEVICE: device,
            D.PHASE: phase,
            P.KV_CACHE_MEMORY: _checked_bytes(opts.kv_cache_memory),
            P.DRAIN_TIMEOUT: P.to_parameter(drain_timeout_s),
            D.CPUS: opts.cpus,
            D.CPU_THREADS: P.to_parameter(opts.cpu_threads),
        }
        if phase == D.CONTEXT:
            params[D.HANDOFF_TIMEOUT] = P.to_parameter(opts.handoff_timeout_s or 30.0)
            params[D.KV_CONNECTOR] = opts.kv_connector or "shm"
            params[D.KV_ADVERTISE_HOST] = opts.kv_advertise_host or ""
        all_fields = scheduler_parameters(engine, opts.scheduler)
        params.update({k: v for k, v in all_fields.items() if k in D.scheduler_fields(phase)})
        config = engine_model_config(params, triton_max_batch_size, name=phase)
        config.input.extend(_inputs(PHASE_INPUTS))
        config.output.extend(_outputs(PHASE_OUTPUTS))
        config.instance_group[0].count = opts.instances
        _write_model(repo, phase, config_text(config, _header(phase, params)), {"model.py": MODEL_PY})
    if only in (D.CONTEXT, D.GENERATION):
        return repo
    router = mc.ModelConfig(
        name=ENSEMBLE, backend="python", max_batch_size=triton_max_batch_size,
        input=_inputs(INPUTS), output=_outputs(OUTPUTS),
        model_transaction_policy=mc.ModelTransactionPolicy(decoupled=True),
        instance_group=[mc.ModelInstanceGroup(kind=mc.ModelInstanceGroup.KIND_CPU, count=1)],
        parameters={k: mc.ModelParameter(string_value=v) for k, v in {
            D.ROLE: D.ROUTER_ROLE, D.CONTEXT_MODEL: D.CONTEXT, D.GENERATION_MODEL: D.GENERATION,
            D.CONTEXT_URLS: context_urls, D.GENERATION_URLS: generation_urls,
            P.EXCLUDE_INPUT_DEFAULT: P.to_parameter(exclude_input_in_output)}.items()})
    header = ["Written by `trtforge emit-repo --disaggregated`: the TensorRT-LLM `ensemble` interface;",
              "this model is the router (TensorRT-LLM's disaggregated_serving_bls): each request",
              "goes to the `context` model (prefill), then to the `generation` model (decode)."]
    _write_model(repo, ENSEMBLE, config_text(router, header), {"model.py": ROUTER_PY})
    return repo


def _header(phase: str, parameters: dict[str, str]) -> list[str]:
    docs = {**P.ADAPTER_PARAMETER_DOCS, **D.PHASE_DOCS, **P.scheduler_field_docs()}
    what = "prefill only: the prompt's KV and first token, handed to `generation`" \
        if phase == D.CONTEXT else "decode only: continues from the KV `context` hands over"
    lines = [f"Written by `trtforge emit-repo --disaggregated`: the {phase} model ({what}).",
             "Parameters:"]
    lines += [f"  {name}: {docs.get(name, '')}" for name in parameters]
    return lines
