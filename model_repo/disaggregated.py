"""Write a disaggregated repository: `ensemble` (the router) → `context` (prefill) → `generation` (decode).

    REPO/
      ensemble/config.pbtxt     the interface clients know; role disaggregated_serving_bls
      ensemble/1/model.py       the router (python_models/router.py)
      context/config.pbtxt      prefill parameters only; request_type, context_phase_params in/out
      context/1/model.py        the engine model (python_models/engine.py), phase context
      generation/config.pbtxt   decode parameters only
      generation/1/model.py     the engine model, phase generation

`emit_worker_router` writes the same router model over co-located workers instead (REPO/ensemble
only; `emit-repo ENGINE REPO --only router --worker-url HOST:PORT …`): each whole request goes to
one `trtforge serve` worker of a plain repository, the one its routing policy picks
(python_models/routing_policy.py).

The router takes the name `ensemble` itself instead of sitting behind it (TensorRT-LLM routes
ensemble → disaggregated_serving_bls): a Triton ensemble in front does not pass client
cancellation on (see emit.py), and a forwarding python model would add one IPC hop per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trtforge.config.runtime import Phase
from trtforge.model_repo.interface import ENSEMBLE, PHASE_INPUTS, PHASE_OUTPUTS
from trtforge.model_repo.params import (
    ENGINE_DIR,
    EXCLUDE_INPUT_DEFAULT,
    AdapterOptions,
    parameter_docs,
    runtime_parameters,
    scheduler_parameters,
    to_parameter,
)
from trtforge.model_repo.pbtxt import config_text, model_inputs, model_outputs, python_model_config, write_model
from trtforge.model_repo.phases import (
    CONTEXT_MODEL,
    CONTEXT_URLS,
    CPU_THREADS,
    CPUS,
    GENERATION_MODEL,
    GENERATION_URLS,
    HANDOFF_TIMEOUT,
    KV_AUTH_KEY_FILE,
    KV_CONNECTOR,
    KV_PEERS,
    KV_TLS_FILES,
    PHASE_DOCS,
    ROLE,
    ROUTER,
    ROUTER_ROLE,
    parse_cpus,
    refuse_other_phase,
    scheduler_fields,
)
from trtforge.model_repo.python_models import ENGINE_PY, ROUTER_PY
from trtforge.model_repo.python_models.routing_policy import (
    ROUTER_DOCS,
    ROUTER_MAX_BLOCKS,
    ROUTER_MAX_IMBALANCE,
    ROUTER_POLICY,
    WORKER_MODEL,
    WORKER_ROUTER_ROLE,
    WORKER_URLS,
    AffinityConfig,
    Policy,
    make_router,
)
from trtforge.models.engine_dir import EngineConfig


@dataclass
class PhaseOptions:
    """What `emit-repo --disaggregated` sets for one phase model (the CLI's --context-* /
    --generation-* options). None: RuntimeConfig's default."""

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
    kv_auth_key_file: str | None = None
    """The handoff key file (both phases; written as an absolute path). None: the one-host key,
    or $TRTFORGE_KV_AUTH_KEY."""
    kv_peers: str | None = None
    """Generation only: the context servers' hosts (HOST or HOST:PORT, comma-separated) whose tcp
    connectors it fetches from."""
    kv_tls_cert_file: str | None = None
    """TLS of the tcp connector (both phases; absolute paths are written): the context server's
    certificate, or the generation server's client certificate (mutual TLS)."""
    kv_tls_key_file: str | None = None
    """The private key of kv_tls_cert_file."""
    kv_tls_ca_file: str | None = None
    """Generation: the CA of the context servers' certificates (TLS on); context: the CA of the
    clients' certificates (mutual TLS)."""


@dataclass
class DisaggregatedOptions:
    """What `emit-repo --disaggregated` writes: the two phase models' options and, for servers
    on different hosts, which of the three models this repository holds."""

    context: PhaseOptions = field(default_factory=PhaseOptions)
    generation: PhaseOptions = field(default_factory=PhaseOptions)
    only: str | None = None
    """Write just one of the three models (context | generation | router); the router then reaches
    the others at context_urls / generation_urls."""
    context_urls: str = ""
    """Router on its own server: gRPC addresses of context servers, comma-separated."""
    generation_urls: str = ""
    """Router on its own server: gRPC addresses of generation servers, comma-separated."""


@dataclass
class WorkerRouterOptions:
    """What `emit-repo --only router --worker-url …` writes: a router over co-located workers
    (each a `trtforge serve` of a plain repository, whose `ensemble` is the engine model)."""

    worker_urls: str
    """gRPC addresses HOST:PORT of the worker servers, comma-separated."""
    policy: str = Policy.PREFIX_AFFINITY.value
    """prefix-affinity | least-loaded (python_models/routing_policy.py)."""
    max_imbalance: int = AffinityConfig.max_imbalance
    """prefix-affinity: at most this many more requests in flight on the chosen worker than on
    the least busy one."""
    max_blocks: int = AffinityConfig.max_blocks
    """prefix-affinity: block hashes remembered per worker."""


def emit_worker_router(engine: EngineConfig, repo: Path, adapter: AdapterOptions, options: WorkerRouterOptions,
                       *, triton_max_batch_size: int) -> Path:
    """The router `ensemble` over the co-located workers at `options.worker_urls`, in `repo`.
    Its engine_dir parameter is the engine's (the router reads its tokenizer and engine.json, not
    its weights; so does the OpenAI front end in front of it)."""
    urls = [u.strip() for u in options.worker_urls.split(",") if u.strip()]
    if not urls:
        raise ValueError("--only router needs the servers it routes to: --worker-url HOST:PORT (repeatable) "
                         "for co-located workers, or --disaggregated with --context-url/--generation-url")
    make_router(options.policy, urls, AffinityConfig(engine.block_size, options.max_blocks,
                                                     options.max_imbalance))  # every check
    params = {ENGINE_DIR: adapter.engine_dir, EXCLUDE_INPUT_DEFAULT: to_parameter(adapter.exclude_input_in_output),
              ROLE: WORKER_ROUTER_ROLE, WORKER_MODEL: ENSEMBLE,
              WORKER_URLS: ",".join(urls), ROUTER_POLICY: str(Policy(options.policy)),
              ROUTER_MAX_IMBALANCE: to_parameter(options.max_imbalance),
              ROUTER_MAX_BLOCKS: to_parameter(options.max_blocks)}
    docs = {**parameter_docs(), **ROUTER_DOCS}
    header = ["Written by `trtforge emit-repo --only router --worker-url …`: the TensorRT-LLM `ensemble`",
              "interface; this model is a router: each request goes to one co-located worker server",
              f"(its `{ENSEMBLE}` model), chosen by `{ROUTER_POLICY}`. Parameters:"]
    header += [f"  {name}: {docs.get(name, '')}" for name in params if name != ROLE]
    repo.mkdir(parents=True, exist_ok=True)
    write_model(repo, ENSEMBLE, config_text(python_model_config(ENSEMBLE, params, triton_max_batch_size), header),
                {"model.py": ROUTER_PY})
    return repo


def emit_disaggregated(engine: EngineConfig, repo: Path, adapter: AdapterOptions, options: DisaggregatedOptions,
                       *, device: str, triton_max_batch_size: int) -> Path:
    """The `context`, `generation` and router `ensemble` models of `engine` (or just
    `options.only`) in `repo`."""
    context, generation, only = options.context, options.generation, options.only
    context_urls, generation_urls = options.context_urls, options.generation_urls
    if only not in (None, Phase.CONTEXT, Phase.GENERATION, ROUTER):
        raise ValueError(f"only={only!r} is invalid: must be context, generation or router")
    if (context_urls or generation_urls) and only != ROUTER:
        raise ValueError("--context-url / --generation-url are for a router on its own server: add --only router")
    if only == ROUTER and not (context_urls and generation_urls):
        raise ValueError("--only router needs --context-url and --generation-url (the servers it routes to)")
    phases = tuple((p, o) for p, o in ((Phase.CONTEXT, context), (Phase.GENERATION, generation))
                   if only in (None, p))
    configs = {}
    for phase, opts in phases:  # every check before anything is written
        refuse_other_phase(phase, [k for k, v in opts.scheduler.items() if v is not None])
        if phase == Phase.GENERATION and (opts.handoff_timeout_s is not None or opts.kv_connector):
            refuse_other_phase(phase, [HANDOFF_TIMEOUT if opts.handoff_timeout_s is not None
                                       else KV_CONNECTOR])
        if phase == Phase.CONTEXT and opts.kv_peers:
            raise ValueError(f"{KV_PEERS} belongs to the generation model (the context servers it "
                             "fetches from), not the context model")
        parse_cpus(opts.cpus)
        if opts.instances < 1:
            raise ValueError(f"{phase} instances={opts.instances} is invalid: must be >= 1")
        files = {name: str(Path(getattr(opts, name)).absolute()) if getattr(opts, name) else None
                 for name in (KV_AUTH_KEY_FILE, *KV_TLS_FILES)}
        runtime = {"device": device, "kv_cache_memory": opts.kv_cache_memory, "phase": phase, **files}
        if phase == Phase.CONTEXT:
            runtime.update(handoff_timeout_s=opts.handoff_timeout_s, kv_connector=opts.kv_connector,
                           kv_advertise_host=opts.kv_advertise_host)
        else:
            runtime[KV_PEERS] = opts.kv_peers
        params = {**adapter.parameters(), **runtime_parameters(**runtime),
                  CPUS: opts.cpus, CPU_THREADS: to_parameter(opts.cpu_threads)}
        all_fields = scheduler_parameters(engine, opts.scheduler)
        params.update({k: v for k, v in all_fields.items() if k in scheduler_fields(phase)})
        config = python_model_config(phase.value, params, triton_max_batch_size)
        config.input.extend(model_inputs(PHASE_INPUTS))
        config.output.extend(model_outputs(PHASE_OUTPUTS))
        config.instance_group[0].count = opts.instances
        configs[phase] = config_text(config, _header(phase, params))
    repo.mkdir(parents=True, exist_ok=True)
    for phase, text in configs.items():
        write_model(repo, phase.value, text, {"model.py": ENGINE_PY})
    if only in (Phase.CONTEXT, Phase.GENERATION):
        return repo
    router = python_model_config(ENSEMBLE, {
        ROLE: ROUTER_ROLE, CONTEXT_MODEL: Phase.CONTEXT.value, GENERATION_MODEL: Phase.GENERATION.value,
        CONTEXT_URLS: context_urls, GENERATION_URLS: generation_urls,
        EXCLUDE_INPUT_DEFAULT: to_parameter(adapter.exclude_input_in_output)},
        triton_max_batch_size)
    header = ["Written by `trtforge emit-repo --disaggregated`: the TensorRT-LLM `ensemble` interface;",
              "this model is the router (TensorRT-LLM's disaggregated_serving_bls): each request",
              "goes to the `context` model (prefill), then to the `generation` model (decode)."]
    write_model(repo, ENSEMBLE, config_text(router, header), {"model.py": ROUTER_PY})
    return repo


def _header(phase: Phase, parameters: dict[str, str]) -> list[str]:
    docs = {**parameter_docs(), **PHASE_DOCS}
    what = "prefill only: the prompt's KV and first token, handed to `generation`" \
        if phase == Phase.CONTEXT else "decode only: continues from the KV `context` hands over"
    lines = [f"Written by `trtforge emit-repo --disaggregated`: the {phase} model ({what}).",
             "Parameters:"]
    lines += [f"  {name}: {docs.get(name, '')}" for name in parameters]
    return lines
