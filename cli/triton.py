"""`trtforge emit-repo`, `trtforge serve` and `trtforge client` (Click commands)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import click

from trtforge.config.fields import dataclass_options, field_docs
from trtforge.config.runtime import Phase, RuntimeConfig
from trtforge.config.scheduler import SchedulerConfig
from trtforge.frontend.tool_parsers import TOOL_CALL_PARSERS
from trtforge.model_repo.params import AdapterOptions
from trtforge.model_repo.phases import CPU_THREADS, CPUS, PHASE_DOCS, ROUTER, scheduler_fields
from trtforge.model_repo.python_models.routing_policy import (
    ROUTER_DOCS,
    ROUTER_MAX_IMBALANCE,
    AffinityConfig,
    Policy,
)
from trtforge.models.errors import EngineLoadError

CONTEXT_RUNTIME_FIELDS = ("handoff_timeout_s", "kv_connector", "kv_advertise_host", "kv_auth_key_file",
                          "kv_tls_cert_file", "kv_tls_key_file", "kv_tls_ca_file")
"""The RuntimeConfig fields of the context model's KV handoff."""
GENERATION_RUNTIME_FIELDS = ("kv_auth_key_file", "kv_peers", "kv_tls_cert_file", "kv_tls_key_file",
                             "kv_tls_ca_file")
"""The RuntimeConfig fields of the generation model's KV handoff."""


def _phase_options(fn):
    """--context-… and --generation-… options of `emit-repo --disaggregated`."""
    for phase in (Phase.GENERATION, Phase.CONTEXT):
        dest = f"{phase}__"
        fn = click.option(f"--{phase}-instances", dest + "instances", type=int, default=1,
                          help=f"Instances (processes, each with its own engine) of the {phase} model. "
                               "[default: 1]")(fn)
        fn = click.option(f"--{phase}-cpu-threads", dest + "cpu_threads", type=int, default=None,
                          help=PHASE_DOCS[CPU_THREADS])(fn)
        fn = click.option(f"--{phase}-cpus", dest + "cpus", default="",
                          help=f"{phase} model: " + PHASE_DOCS[CPUS])(fn)
        fn = click.option(f"--{phase}-kv-cache-memory", dest + "kv_cache_memory", default=None,
                          help=f"KV cache memory of the {phase} model, e.g. 512MiB "
                               "(default: engine.json's budget).")(fn)
        # --context-handoff-timeout-s, --context-kv-connector, …, --generation-kv-peers
        fields = CONTEXT_RUNTIME_FIELDS if phase == Phase.CONTEXT else GENERATION_RUNTIME_FIELDS
        fn = dataclass_options(RuntimeConfig, only=fields, prefix=f"{phase}-", dest_prefix=dest)(fn)
        fn = dataclass_options(SchedulerConfig, only=scheduler_fields(phase), prefix=f"{phase}-",
                               dest_prefix=dest,
                               default_text="the engine's engine.json value, else {default}")(fn)
    return fn


def _trtllm_options(fn):
    """--trtllm-repo, --trtllm-version and --allow-trtllm-drift of `emit-repo`: the fields of
    TrtllmOptions (model_repo/trtllm/options.py), whose docs are the help text."""
    from trtforge.config.fields import field_docs
    from trtforge.model_repo.trtllm.options import REPO_KINDS, TrtllmOptions

    docs = field_docs(TrtllmOptions)
    fn = click.option("--allow-trtllm-drift/--no-allow-trtllm-drift", "allow_trtllm_drift", default=None,
                      help=docs["allow_drift"] + " --no-allow-trtllm-drift stops even where the "
                           "variable is set.")(fn)
    fn = click.option("--trtllm-version", default=None, metavar="VERSION",
                      help=docs["version"])(fn)
    return click.option("--trtllm-repo", type=click.Choice(REPO_KINDS), default=None,
                        help=f"TensorRT-LLM repository kind: {docs['repo']} With llmapi, ENGINE_DIR is "
                             f"that checkpoint. [default: {TrtllmOptions.repo}]")(fn)


LLMAPI_REFUSED = ("device", "triton_max_batch_size", "exclude_input_in_output", "kv_events_endpoint")
"""emit-repo options the llmapi repository has no place for (TensorRT-LLM places the model and
batches as model.yaml says)."""


@click.command("emit-repo")
@click.argument("engine_dir", type=click.Path(file_okay=False))
@click.argument("repo_dir", type=click.Path(file_okay=False))
@click.option("--device", default=RuntimeConfig.device, show_default=True,
              help=RuntimeConfig.field_docs()["device"])
@click.option("--triton-max-batch-size", type=int, default=None,
              help="max_batch_size of the Triton model (the batch dimension clients send; one "
                   "prompt per request). Default: the engine's max_batch_size.")
@click.option("--exclude-input-in-output/--include-input-in-output",
              default=AdapterOptions.exclude_input_in_output,
              show_default=True,
              help="Default for requests that do not send exclude_input_in_output: leave the "
                   "prompt out of non-streamed text_output (TensorRT-LLM includes it).")
@click.option("--kv-cache-memory", default=None,
              help="Memory for the paged KV cache, e.g. 512MiB (default: engine.json's budget).")
@click.option("--kv-events-endpoint", default=AdapterOptions.kv_events_endpoint,
              help=field_docs(AdapterOptions)["kv_events_endpoint"])
@click.option("--speculative-config", default=None, metavar="JSON",
              help="The engine model's speculative_config parameter: "
                   + RuntimeConfig.field_docs()["speculative_config"]
                   + " Not for --backend trtllm engines, --trtllm-repo llmapi, --disaggregated or a router.")
@click.option("--trtllm-models-dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="--backend trtllm engines: TensorRT-LLM's all_models/inflight_batcher_llm to copy "
                   "the python models' model.py from (default: the NGC image's /app/all_models/"
                   "inflight_batcher_llm when it exists). --trtllm-repo llmapi reads the LLM-API "
                   "model's files and template beside it, in all_models/llmapi.")
@click.option("--disaggregated", is_flag=True,
              help="Separate context (prefill) and generation (decode) models behind the "
                   "ensemble, each with its own --context-… / --generation-… parameters "
                   "(trtllm engines: TensorRT-LLM's disaggregated repository, two GPUs).")
@click.option("--only", type=click.Choice([Phase.CONTEXT.value, Phase.GENERATION.value, ROUTER]),
              default=None,
              help="With --disaggregated: write just this model, for servers on different hosts "
                   "(a context server with --context-kv-connector tcp://…, a generation server, and a "
                   "router server with --context-url/--generation-url). `--only router --worker-url …` "
                   "without --disaggregated: a router over co-located workers.")
@click.option("--context-url", "context_urls", multiple=True,
              help="--only router: gRPC HOST:PORT of a context server (repeatable).")
@click.option("--generation-url", "generation_urls", multiple=True,
              help="--only router: gRPC HOST:PORT of a generation server (repeatable).")
@click.option("--worker-url", "worker_urls", multiple=True,
              help="--only router (no --disaggregated): gRPC HOST:PORT of a co-located worker server, a "
                   "`trtforge serve` of a plain `emit-repo` repository of this engine (repeatable).")
@click.option("--router-policy", type=click.Choice([p.value for p in Policy]), default=None,
              help="--worker-url: how the router picks a worker: prefix-affinity (the one most likely to "
                   "hold the prompt's KV blocks, balanced by requests in flight) or least-loaded. "
                   f"[default: {Policy.PREFIX_AFFINITY}]")
@click.option("--router-max-imbalance", type=click.IntRange(min=0), default=None,
              help="--router-policy prefix-affinity: " + ROUTER_DOCS[ROUTER_MAX_IMBALANCE]
                   + f" [default: {AffinityConfig.max_imbalance}]")
@_trtllm_options
@dataclass_options(SchedulerConfig, exclude=SchedulerConfig.ENGINE_FIELDS,
                   default_text="the engine's engine.json value, else {default}")
@_phase_options
def emit_repo_command(engine_dir: str, repo_dir: str, device: str,
                      triton_max_batch_size: int | None, exclude_input_in_output: bool,
                      kv_cache_memory: str | None, kv_events_endpoint: str, speculative_config: str | None,
                      trtllm_models_dir: str | None,
                      disaggregated: bool, only: str | None, context_urls: tuple[str, ...],
                      generation_urls: tuple[str, ...], worker_urls: tuple[str, ...],
                      router_policy: str | None, router_max_imbalance: int | None, trtllm_repo: str | None,
                      trtllm_version: str | None, allow_trtllm_drift: bool | None,
                      **options: object) -> None:
    """Write a Triton model repository (model `ensemble`) serving ENGINE_DIR into REPO_DIR.

    Scheduling options given here are written into ensemble/config.pbtxt as parameters; the
    others get the engine's defaults. Edit them there later: the model checks them when loading.
    With --disaggregated, the --context-… and --generation-… options go into context/ and
    generation/config.pbtxt instead. `--only router --worker-url HOST:PORT …` writes a router
    over co-located worker servers instead (docs/scale-out.md).

    With --trtllm-repo llmapi, ENGINE_DIR is a Hugging Face checkpoint (directory or hub id)
    instead, and REPO_DIR gets TensorRT-LLM's LLM-API model `tensorrt_llm` (docs/tensorrt-llm.md).
    """
    from trtforge.builder.trtllm.versions import TrtllmDrift
    from trtforge.model_repo.disaggregated import DisaggregatedOptions  # keeps `trtforge --help` fast
    from trtforge.model_repo.emit import emit_repo
    from trtforge.model_repo.trtllm.options import TrtllmOptions
    from trtforge.models.errors import BuildError

    llmapi = trtllm_repo == "llmapi"
    if not llmapi and not Path(engine_dir).is_dir():  # a hub id is a checkpoint for llmapi only
        raise click.BadParameter(f"Directory {engine_dir!r} does not exist.", param_hint="'ENGINE_DIR'")
    ctx = click.get_current_context()
    refused = [n for n in LLMAPI_REFUSED if ctx.get_parameter_source(n) == click.core.ParameterSource.COMMANDLINE]
    if llmapi and refused:
        raise click.UsageError(", ".join("--" + n.replace("_", "-") for n in refused) + ": not options of "
                               "the llmapi repository (TensorRT-LLM places the model, and batches as "
                               "model.yaml's triton_config says)")
    phase_opts = {k: v for k, v in options.items() if "__" in k}
    scheduler = {k: v for k, v in options.items() if "__" not in k and v is not None}
    try:
        phases = _phase_values(phase_opts, disaggregated)
        routed = _worker_router(disaggregated, only, worker_urls, router_policy, router_max_imbalance)
        if (only or context_urls or generation_urls) and not disaggregated and (not routed or context_urls
                                                                               or generation_urls):
            raise ValueError("--only context|generation, --context-url and --generation-url need "
                             "--disaggregated (a router over co-located workers takes --worker-url)")
        layout = DisaggregatedOptions(**phases, only=only, context_urls=",".join(context_urls),
                                      generation_urls=",".join(generation_urls)) if disaggregated else routed
        repo = emit_repo(engine_dir, repo_dir, device=device,
                         triton_max_batch_size=triton_max_batch_size,
                         exclude_input_in_output=exclude_input_in_output,
                         kv_cache_memory=kv_cache_memory, kv_events_endpoint=kv_events_endpoint,
                         trtllm_models_dir=TrtllmOptions(trtllm_models_dir, trtllm_repo or TrtllmOptions.repo,
                                                         trtllm_version, allow_trtllm_drift),
                         disaggregated=layout, speculative_config=speculative_config, **scheduler)
    except TrtllmDrift as exc:
        raise click.ClickException(f"{exc}\nOn the command line: --allow-trtllm-drift.") from None
    except (ValueError, FileNotFoundError, EngineLoadError, BuildError) as exc:
        raise click.ClickException(str(exc)) from None
    written = {Phase.CONTEXT: "`context`", Phase.GENERATION: "`generation`", ROUTER: "`ensemble` (router)"}
    models = ("`tensorrt_llm`" if llmapi else written[only] if only
              else "`ensemble`, `context`, `generation`" if phases else "`ensemble`")
    click.echo(f"Wrote Triton model repository {repo} (models {models}). "
               f"Serve it with: trtforge serve {repo}")


def _worker_router(disaggregated: bool, only: str | None, worker_urls: tuple[str, ...], policy: str | None,
                   max_imbalance: int | None):
    """The WorkerRouterOptions of `--only router --worker-url …` (no --disaggregated); False for
    every other layout, where --worker-url and the --router-… options are refused."""
    from trtforge.model_repo.disaggregated import WorkerRouterOptions

    tuning = [flag for flag, v in (("--router-policy", policy), ("--router-max-imbalance", max_imbalance))
              if v is not None]
    if disaggregated and (worker_urls or tuning):
        raise ValueError(f"{', '.join(['--worker-url'] * bool(worker_urls) + tuning)}: options of a router over "
                         "co-located workers (`--only router --worker-url …`, no --disaggregated); a "
                         "disaggregated router takes --context-url and --generation-url")
    if disaggregated or only != ROUTER:
        if worker_urls or tuning:
            raise ValueError(f"{', '.join(['--worker-url'] * bool(worker_urls) + tuning)}: only with --only router")
        return False
    if not worker_urls:
        raise ValueError("--only router without --disaggregated routes over co-located workers: give "
                         "--worker-url HOST:PORT (repeatable); for context and generation servers add "
                         "--disaggregated with --context-url and --generation-url")
    return WorkerRouterOptions(",".join(worker_urls), policy or WorkerRouterOptions.policy,
                               WorkerRouterOptions.max_imbalance if max_imbalance is None else max_imbalance)


def _phase_values(options: dict[str, object], disaggregated: bool) -> dict[str, object]:
    """{"context": PhaseOptions, "generation": PhaseOptions} from the --context-… / --generation-…
    options (empty without --disaggregated, where giving one is an error)."""
    given = sorted(k for k, v in options.items()
                   if v is not None and v != "" and not (k.endswith("__instances") and v == 1))
    if not disaggregated:
        if given:
            flags = ", ".join("--" + k.replace("__", "-").replace("_", "-") for k in given)
            raise ValueError(f"{flags}: phase options need --disaggregated")
        return {}
    from trtforge.model_repo.disaggregated import PhaseOptions

    out = {}
    for phase in (Phase.CONTEXT, Phase.GENERATION):
        mine = {k.split("__", 1)[1]: v for k, v in options.items() if k.startswith(f"{phase}__")}
        out[phase.value] = PhaseOptions(
            scheduler={k: mine[k] for k in scheduler_fields(phase) if mine.get(k) is not None},
            kv_cache_memory=mine.get("kv_cache_memory"), cpus=mine.get("cpus") or "",
            cpu_threads=mine.get("cpu_threads"), instances=mine.get("instances") or 1,
            handoff_timeout_s=mine.get("handoff_timeout_s"), kv_connector=mine.get("kv_connector"),
            kv_advertise_host=mine.get("kv_advertise_host"),
            kv_auth_key_file=mine.get("kv_auth_key_file"), kv_peers=mine.get("kv_peers"),
            kv_tls_cert_file=mine.get("kv_tls_cert_file"), kv_tls_key_file=mine.get("kv_tls_key_file"),
            kv_tls_ca_file=mine.get("kv_tls_ca_file"))
    return out


class _Shutdown(Exception):
    """Raised in the main thread by our SIGINT/SIGTERM handler."""


def _raise_shutdown(signum: int, _frame: object) -> None:
    raise _Shutdown(signal.Signals(signum).name)


OPENAI_ONLY_OPTIONS = ("openai_host", "served_model_name", "served_engine_dir", "api_key", "api_keys_file",
                       "api_key_cache_salt", "max_request_bytes", "max_prompt_chars", "tool_call_parser")
"""`serve` options that mean something only with --openai-port."""


def _check_openai_options(openai_port: int | None) -> None:
    """Refuse OpenAI options given on the command line without --openai-port: an --api-key that
    protects nothing must not look as if it protected Triton's own ports."""
    if openai_port is not None:
        return
    ctx = click.get_current_context()
    given = [name for name in OPENAI_ONLY_OPTIONS
             if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise click.UsageError(f"{flags}: options of the OpenAI-compatible API, which runs only with "
                               "--openai-port (Triton's own HTTP/gRPC ports take no API key)")


def _read_keys(path: str | None) -> tuple[str, ...]:
    """The keys of --api-keys-file: one per line, blank lines and # comments skipped."""
    if path is None:
        return ()
    lines = (line.strip() for line in Path(path).read_text().splitlines())
    return tuple(line for line in lines if line and not line.startswith("#"))


@click.command("serve")
@click.argument("repo", type=click.Path(exists=True, file_okay=False))
@click.option("--http-port", type=int, default=8000, show_default=True, help="0: any free port.")
@click.option("--grpc-port", type=int, default=8001, show_default=True, help="0: any free port.")
@click.option("--metrics-port", type=int, default=8002, show_default=True,
              help="Prometheus /metrics port (0: any free port).")
@click.option("--tritonserver", "tritonserver", default=None,
              help="tritonserver executable. Default: $TRTFORGE_TRITONSERVER, then "
                   "/opt/tritonserver/bin/tritonserver, then the one in the nvidia-pytriton wheel.")
@click.option("--ready-timeout", type=float, default=600.0, show_default=True,
              help="Seconds to wait for the models to load.")
@click.option("--log-file", type=click.Path(dir_okay=False), default=None,
              help="Write tritonserver's output here instead of the console.")
@click.option("--openai-port", type=int, default=None,
              help="Also serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions, "
                   "/v1/models, /health) on this port, forwarding to Triton (0: any free port).")
@click.option("--openai-host", default="127.0.0.1", show_default=True,
              help="Interface the OpenAI-compatible API listens on: loopback, this machine only. "
                   "0.0.0.0 (or ::) opens it to the network; give it --api-key then.")
@click.option("--served-model-name", default=None,
              help="Model id of the OpenAI-compatible API. Default: the engine directory's name.")
@click.option("--served-engine-dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="Engine directory whose tokenizer and limits the OpenAI-compatible API uses, instead "
                   "of the one the repository names: for a disaggregated router on its own host "
                   "(`emit-repo --only router`), a copy of the engine the phase models serve.")
@click.option("--api-key", envvar="TRTFORGE_API_KEY", show_envvar=True, default=None,
              help="Require 'Authorization: Bearer KEY' on every route of the OpenAI-compatible API "
                   "but /health (401 otherwise). Prefer the environment variable: other users see "
                   "command lines in `ps`. Triton's own ports are not protected by it.")
@click.option("--api-keys-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="More API keys accepted beside --api-key, one per line (one per tenant, say); "
                   "blank lines and lines starting with # are skipped.")
@click.option("--api-key-cache-salt/--no-api-key-cache-salt", default=False, show_default=True,
              help="Give every API key its own prefix-cache namespace: requests made with different "
                   "keys never share cached KV blocks, so one tenant cannot time another's prompts. "
                   "Needs an API key.")
@click.option("--max-request-bytes", type=click.IntRange(min=1), default=None,
              help="Largest request body the OpenAI-compatible API reads (413 beyond it). Default: "
                   "6 bytes per --max-prompt-chars character, at least 1 MiB.")
@click.option("--max-prompt-chars", type=click.IntRange(min=1), default=None,
              help="Most characters of prompt text per OpenAI request (the prompt, or the messages' "
                   "texts and names, plus stop strings), checked before tokenizing (400 beyond it). "
                   "Default: 16 per token of the engine's max_seq_len.")
@click.option("--tool-call-parser", type=click.Choice(sorted(TOOL_CALL_PARSERS)), default=None,
              help="How the OpenAI-compatible API reads tool calls from the model's output: hermes "
                   "(<tool_call> JSON: Hermes, Qwen), llama3_json (Llama 3.x JSON), mistral ([TOOL_CALLS]). "
                   "Default: the chat template's own format, else hermes.")
def serve_command(repo: str, http_port: int, grpc_port: int, metrics_port: int,
                  tritonserver: str | None, ready_timeout: float, log_file: str | None,
                  openai_port: int | None, openai_host: str,
                  served_model_name: str | None, served_engine_dir: str | None, api_key: str | None,
                  api_keys_file: str | None, api_key_cache_salt: bool, max_request_bytes: int | None,
                  max_prompt_chars: int | None, tool_call_parser: str | None) -> None:
    """Run Triton Inference Server on REPO in the foreground; Ctrl-C / SIGTERM stops it.

    With --openai-port, an OpenAI-compatible API runs beside it, forwarding to Triton."""
    from trtforge.frontend.guard import Limits
    from trtforge.frontend.service import OpenAIFrontend
    from trtforge.model_repo.launcher import TritonServer

    _check_openai_options(openai_port)
    try:
        limits = Limits(api_key=api_key or None, api_keys=_read_keys(api_keys_file),
                        api_key_cache_salt=api_key_cache_salt, max_request_bytes=max_request_bytes,
                        max_prompt_chars=max_prompt_chars)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    server = TritonServer(Path(repo), http_port=http_port, grpc_port=grpc_port,
                          metrics_port=metrics_port, tritonserver=tritonserver,
                          log_file=Path(log_file) if log_file else None)
    frontend = OpenAIFrontend(repo, openai_host, openai_port, served_model_name, limits, served_engine_dir,
                              tool_call_parser)
    previous = {s: signal.signal(s, _raise_shutdown) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        frontend.prepare()  # a repository it cannot serve fails before Triton starts
        server.start()
        server.wait_ready(ready_timeout)
        click.echo(f"Triton is ready: HTTP http://{server.http_url}  gRPC {server.grpc_url}  "
                   f"metrics {server.metrics_url}\n"
                   f"  try: trtforge client --url {server.grpc_url} --prompt 'Hello' --stream")
        banner = frontend.start(server.grpc_url)
        if banner:
            click.echo(banner)
        code = server.process.wait()
        raise click.ClickException(f"tritonserver exited on its own with code {code}; "
                                   f"see its output above{' and ' + log_file if log_file else ''}.")
    except _Shutdown as sig:
        click.echo(f"{sig}: stopping Triton (in-flight requests get up to "
                   f"{server.exit_timeout_s} s) …")
    except (FileNotFoundError, RuntimeError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        frontend.stop()
        code = server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    click.echo(f"Triton stopped (exit code {code}).")


@click.command("client")
@click.option("--url", default=None,
              help="Server address. Default: localhost:8001 for gRPC, localhost:8000 for HTTP.")
@click.option("--protocol", type=click.Choice(["grpc", "http"]), default="grpc",
              show_default=True)
@click.option("--prompt", required=True, help="Text to continue.")
@click.option("--max-tokens", type=int, default=64, show_default=True)
@click.option("--stream/--no-stream", default=False, show_default=True,
              help="Print text as it is generated (gRPC stream or HTTP /generate_stream); "
                   "otherwise one /generate-style answer.")
@click.option("--temperature", type=float, default=None, help="0: greedy (the server default).")
@click.option("--top-k", type=int, default=None)
@click.option("--top-p", type=float, default=None)
@click.option("--seed", type=int, default=None)
@click.option("--stop-word", "stop_words", multiple=True, help="Stop string (repeatable).")
@click.option("--model", default="ensemble", show_default=True)
def client_command(url: str | None, protocol: str, prompt: str, max_tokens: int, stream: bool,
                   temperature: float | None, top_k: int | None, top_p: float | None,
                   seed: int | None, stop_words: tuple[str, ...], model: str) -> None:
    """Send one prompt to a trtforge (or TensorRT-LLM) Triton server and print the answer."""
    from tritonclient.utils import InferenceServerException

    from trtforge.model_repo import client

    url = url or ("localhost:8001" if protocol == "grpc" else "localhost:8000")
    options = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                   stop_words=list(stop_words) or None, model=model)
    try:
        if protocol == "grpc":
            for piece in client.stream_grpc(url, prompt, max_tokens, stream=stream, **options):
                click.echo(piece, nl=False)
                sys.stdout.flush()
        elif stream:
            for event in client.stream_http(url, prompt, max_tokens, **options):
                click.echo(event.get("text_output", ""), nl=False)
                sys.stdout.flush()
        else:
            click.echo(client.generate_http(url, prompt, max_tokens, **options)["text_output"],
                       nl=False)
    except (RuntimeError, TimeoutError, OSError, InferenceServerException) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo()
