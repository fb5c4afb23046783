"""The router of a disaggregated repository (TensorRT-LLM's `disaggregated_serving_bls`).

Copied into `<repo>/ensemble/1/model.py` by `trtforge emit-repo --disaggregated`: clients call
`ensemble` with the interface they already use, and each request goes

    ensemble (this model) ──gRPC stream, request_type=context_only──▶ context   prompt KV + first token
                          ◀── first token, context_phase_params (the KV handle) ──
                          ──gRPC stream, generation_only + handle──▶ generation   decode
                          ◀── text deltas … final ──

Both phases are always asked for streamed deltas without the prompt; this model forwards them
to a streaming client as they come, or joins them into the one answer of a non-streamed request,
so clients see exactly what the co-located model sends. Errors of either phase (a prompt too long
for the context model, an expired handoff, a server gone) are forwarded as that request's error.

The phase models are reached by gRPC (tritonclient), on this server or on others
(`context_urls`, `generation_urls`; several of a kind: the least-loaded first). Not BLS: under
concurrent streaming, Triton 2.51's python backend crashed the server (heap corruption in
ResponseFactoryIsCancelled) when BLS requests fed a decoupled model; as gRPC clients the phase
models are served exactly like the co-located model. On this server the address is
$TRTFORGE_TRITON_GRPC_URL (set by `trtforge serve`), else Triton's default 127.0.0.1:8001.

Threads: one per request in flight (the gRPC streams block); ONE response thread (base.py) that
does every `send` and, in `watch()`, every `is_cancelled()` check, one after the other (an
`is_cancelled()` racing a final `send` of the same request from another thread is the same
crash); and a canceller that cancels
the gRPC stream of a request whose client went away: the phase model frees its KV blocks at once.
A handoff nobody takes (the client left between the phases) is freed by the context model after
`handoff_timeout_s`. A server that has gone away fails the requests it was serving with a
message naming it; what such a request held elsewhere is freed (the context server's handoff by
its deadline, or at once when it was taken).

The same file is the router over co-located workers (`emit-repo --only router --worker-url …`,
role `router`): each whole request goes, by the same gRPC stream, to one `trtforge serve` worker
whose `ensemble` is the engine model, chosen by routing_policy.py (prefix affinity: the worker
most likely to hold the prompt's KV blocks; or least-loaded). Its answers are relayed as the
phases' are, with the same cancellation and errors ("the worker server X failed this request").
"""

from __future__ import annotations

import os
import queue
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import triton_python_backend_utils as pb_utils

from trtforge.config.runtime import Phase
from trtforge.model_repo.interface import ENSEMBLE, OUTPUTS
from trtforge.model_repo.params import ENGINE_DIR, AdapterOptions
from trtforge.model_repo.phases import (
    CONTEXT_MODEL,
    CONTEXT_PHASE_PARAMS,
    CONTEXT_URLS,
    GENERATION_MODEL,
    GENERATION_URLS,
    REQUEST_TYPE,
    ROLE,
    RequestType,
)
from trtforge.model_repo.python_models.base import (
    INTERFACE_INPUTS,
    Answer,
    DecoupledModel,
    model_parameters,
)
from trtforge.model_repo.python_models.routing_policy import (
    ROUTER_MAX_BLOCKS,
    ROUTER_MAX_IMBALANCE,
    ROUTER_POLICY,
    WORKER_MODEL,
    WORKER_ROUTER_ROLE,
    WORKER_URLS,
    AffinityConfig,
    LeastLoaded,
    Policy,
    block_hashes,
    make_router,
)
from trtforge.model_repo.request import GenerationRequest, parse_request

_OUTPUT_NAMES = [s.name for s in OUTPUTS] + [CONTEXT_PHASE_PARAMS]
FINAL_FIELDS = ("finish_reason", "stop_reason", "stop_token_id", "num_cached_tokens")
"""Answer fields of a request's last response (beside its counts), forwarded as they come."""
_DRAIN_TIMEOUT_S = 10.0  # how long finalize() lets requests in flight finish
WORKER = "worker"
"""The one hop of a router over co-located workers (beside the phases context and generation)."""


@dataclass
class _Flight:
    """A request being routed: its client, and what the phase models have answered so far."""

    sender: Any
    stopped: bool = False
    """The client went away: the phase in progress is cancelled, the next one not started."""
    text: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    cum_logprob: float | None = None
    num_tokens: dict[str, int] = field(default_factory=dict)
    final: dict[str, Any] = field(default_factory=dict)
    """What the last phase's last answer said about the end: finish_reason, stop_reason,
    stop_token_id, num_cached_tokens."""
    cached: int | None = None
    """Prompt tokens the context model served from its prefix cache (the generation model's
    prompt KV is handed over, not cached): reported on the last response."""
    cancel: Any = None
    """Cancels the gRPC stream of the phase in progress (its server frees the request's KV)."""
    last: Any = None
    """A streamed client's last response: sent, with FINAL, once the generation phase's gRPC
    stream has ended (`_route`)."""
    final_sent: bool = False
    """The client got its final response: its sender must not be touched again (Triton 2.51
    crashes in ResponseFactoryIsCancelled on a completed request)."""


class TritonPythonModel(DecoupledModel):
    watch_s = 0.02  # how often the response thread looks for cancelled clients

    def initialize(self, args: dict[str, str]) -> None:
        parameters = model_parameters(args)
        self.exclude_input_default = AdapterOptions.from_parameters(parameters).exclude_input_in_output
        here = os.environ.get("TRTFORGE_TRITON_GRPC_URL") or "127.0.0.1:8001"
        self.colocated = parameters.get(ROLE) == WORKER_ROUTER_ROLE
        self._tokenizer, self._block_size = None, 0
        if self.colocated:  # one hop: a co-located worker's engine model
            self.models = {WORKER: parameters.get(WORKER_MODEL) or ENSEMBLE}
            urls = _urls(parameters.get(WORKER_URLS, ""))
            if not urls:
                raise ValueError(f"parameter {WORKER_URLS!r} is empty: the router needs the worker "
                                 "servers' gRPC addresses (emit-repo --only router --worker-url …)")
            policy = parameters.get(ROUTER_POLICY) or Policy.PREFIX_AFFINITY.value
            affinity = self._affinity(args, parameters) if policy == Policy.PREFIX_AFFINITY else \
                AffinityConfig(block_size=1)
            self.routers = {WORKER: make_router(policy, urls, affinity)}
        else:  # two hops: context, then generation
            self.models = {Phase.CONTEXT: parameters.get(CONTEXT_MODEL) or Phase.CONTEXT.value,
                           Phase.GENERATION: parameters.get(GENERATION_MODEL) or Phase.GENERATION.value}
            self.routers = {phase: LeastLoaded(_urls(parameters.get(name, "")) or [here])
                            for phase, name in ((Phase.CONTEXT, CONTEXT_URLS),
                                                (Phase.GENERATION, GENERATION_URLS))}
        self._flights: dict[str, _Flight] = {}
        self.start_responses(pb_utils, "trtforge-router-send")
        self._cancels: queue.Queue = queue.Queue()  # flights whose client went away
        self._canceller = threading.Thread(target=self._cancel_loop, name="trtforge-router-cancel",
                                           daemon=True)
        self._canceller.start()

    def execute(self, requests: list[Any]) -> None:
        self.intake(requests, INTERFACE_INPUTS, lambda arrays: parse_request(arrays, self.exclude_input_default),
                    self._accept)

    def _accept(self, sender: Any, parsed: Any, inputs: dict[str, np.ndarray]) -> None:
        """A route thread per request; `inputs` (copies) are read by it."""
        key = uuid.uuid4().hex
        self._flights[key] = _Flight(sender)
        threading.Thread(target=self._route, args=(key, parsed, inputs), daemon=True,
                         name=f"trtforge-route-{key[:8]}").start()

    def finalize(self) -> None:
        self.drain(_DRAIN_TIMEOUT_S, lambda: bool(self._flights))
        self._cancels.put(None)
        self._canceller.join(timeout=5)
        self.stop_responses(timeout_s=5)

    # -- one request (its route thread) --------------------------------------------------------
    def _route(self, key: str, parsed: GenerationRequest, inputs: dict[str, np.ndarray]) -> None:
        """Context phase, then (unless the client left) generation phase; then the final response."""
        flight = self._flights[key]
        try:
            if self.colocated:
                self._phase(key, flight, parsed, WORKER, inputs, None, self._blocks(parsed))
            elif (handle := self._phase(key, flight, parsed, Phase.CONTEXT, inputs, None)) is not None \
                    and not flight.stopped:
                self._phase(key, flight, parsed, Phase.GENERATION, inputs, handle)
            if not parsed.stream and not flight.stopped and flight.num_tokens:
                self._final(flight, self._joined(flight, parsed))  # one response, as co-located
            else:
                self._final(flight, flight.last)
        except _PhaseError as exc:
            self._final(flight, exc.response)
        except Exception as exc:  # noqa: BLE001 - answer the client whatever went wrong
            self._final(flight, self.error(f"routing failed: {type(exc).__name__}: {exc}"))
        finally:
            with self._lock:
                self._flights.pop(key, None)

    def _final(self, flight: _Flight, response: Any) -> None:
        """Queue the client's last response (once), marked first so that the response thread no
        longer checks its client (see _scan_cancelled)."""
        with self._lock:
            if flight.final_sent:
                return
            flight.final_sent = True
        self.send(flight.sender, response, self.final)

    def _phase(self, key: str, flight: _Flight, parsed: GenerationRequest, hop: str,
               inputs: dict[str, np.ndarray], handle: bytes | None, blocks: list[int] | None = None) -> bytes | None:
        """Run one hop (a phase, or the whole request on a worker), forwarding (or collecting)
        its deltas; the context phase's handle."""
        arrays = {name: a for name, a in inputs.items() if name not in ("stream", "exclude_input_in_output")}
        arrays.update({"stream": np.array([[True]]), "exclude_input_in_output": np.array([[True]])})
        if hop != WORKER:
            arrays[REQUEST_TYPE] = np.array([[RequestType.of(Phase(hop)).encode()]], dtype=object)
        if handle is not None:
            arrays[CONTEXT_PHASE_PARAMS] = np.array([[handle]], dtype=object)
        handed = None
        for answer in self._stream(flight, hop, arrays, key, blocks or []):
            if answer.context_phase_params is not None:
                handed, answer.context_phase_params = answer.context_phase_params, None
            self._forward(flight, parsed, answer)
        return handed

    def _stream(self, flight: _Flight, phase: str, arrays: dict[str, np.ndarray],
                key: str, blocks: list[int]) -> Iterator[Answer]:
        """One hop: a gRPC stream to the server its policy picks (`blocks`: the prompt's block
        hashes, for prefix affinity); its answers."""
        import tritonclient.grpc as grpcclient

        from trtforge.model_repo.client import infer_inputs

        with self._lock:
            url = self.routers[phase].choose(blocks)
        responses: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(url)
        finished = False
        try:
            try:
                client.start_stream(callback=lambda result, error: responses.put((result, error)))
                flight.cancel = lambda: client.stop_stream(cancel_requests=True)
                client.async_stream_infer(self.models[phase], infer_inputs(arrays),
                                          request_id=key, enable_empty_final_response=True)
            except Exception as exc:  # noqa: BLE001 - unreachable, gone: this request fails
                finished = True
                self._failed(phase, url)
                raise _PhaseError(self.error(f"the {phase} server {url} failed this request: {exc}",
                                             "UNAVAILABLE")) from None
            while not finished:
                if flight.stopped:  # cancelled by the client: the finally cancels the stream
                    raise _PhaseError(self.error("the request was cancelled", "UNAVAILABLE"))
                try:
                    result, error = responses.get(timeout=0.5)
                except queue.Empty:
                    if flight.stopped:  # cancelled: the stream may end without a word
                        raise _PhaseError(self.error("the request was cancelled", "UNAVAILABLE")) from None
                    continue
                if error is not None:
                    finished = True
                    if _broken(error):
                        self._failed(phase, url)
                    raise _PhaseError(self.error(f"the {phase} server {url} failed this request: "
                                                 f"{error}", "UNAVAILABLE"))
                finished = result.get_response().parameters["triton_final_response"].bool_param
                outputs = {n: result.as_numpy(n) for n in _OUTPUT_NAMES}
                outputs = {n: a for n, a in outputs.items() if a is not None}
                if outputs:
                    yield Answer.of_arrays(outputs)
        finally:
            flight.cancel = None
            try:
                client.stop_stream(cancel_requests=not finished)
                client.close()
            except Exception:  # noqa: BLE001 - already closed by a cancel
                pass
            with self._lock:
                self.routers[phase].release(url)

    def _failed(self, hop: str, url: str) -> None:
        with self._lock:
            self.routers[hop].failed(url)

    def _forward(self, flight: _Flight, parsed: GenerationRequest, answer: Answer) -> None:
        """Record a phase's answer; a streamed client gets it at once, or (its last) at the end."""
        new_logprobs = answer.logprobs or []
        if answer.cum_logprob is not None:
            flight.cum_logprob = answer.cum_logprob
        if answer.num_output_tokens is None and answer.num_cached_tokens is not None:
            flight.cached, answer.num_cached_tokens = answer.num_cached_tokens, None  # the handoff's
        elif answer.num_output_tokens is not None and flight.cached is not None:
            answer.num_cached_tokens = flight.cached  # the generation model's last answer
        for name in ("num_input_tokens", "num_output_tokens"):
            if getattr(answer, name) is not None:
                flight.num_tokens[name] = getattr(answer, name)
        for name in FINAL_FIELDS:
            if getattr(answer, name) is not None:
                flight.final[name] = getattr(answer, name)
        flight.text.append(answer.text)
        flight.logprobs += new_logprobs
        flight.top_logprobs += answer.top_logprobs or []
        if parsed.stream and (answer.text or new_logprobs or answer.num_output_tokens is not None):
            response = answer.response(pb_utils)
            if answer.num_output_tokens is not None:  # the phase model's last answer: sent with
                flight.last = response                # FINAL once its gRPC stream has ended
            else:
                self.send(flight.sender, response)

    def _affinity(self, args: dict[str, str], parameters: dict[str, str]) -> AffinityConfig:
        """Prefix affinity hashes the prompt's tokens: the engine directory's tokenizer and
        kv_block_size (engine.json; no weights are read)."""
        from trtforge.models.engine_dir import read_engine_config
        from trtforge.models.tokenizer import load_tokenizer

        engine_dir = Path(parameters.get(ENGINE_DIR) or "")
        if not parameters.get(ENGINE_DIR):
            raise ValueError(f"parameter {ENGINE_DIR!r} is missing: prefix affinity tokenizes prompts "
                             "with the engine's tokenizer (re-emit with `emit-repo ENGINE --only router`)")
        if not engine_dir.is_absolute():
            engine_dir = Path(args["model_repository"]) / engine_dir
        engine = read_engine_config(engine_dir, verify_weights=False)
        self._tokenizer, self._block_size = load_tokenizer(engine_dir), engine.block_size
        given = {}
        for param, name in ((ROUTER_MAX_BLOCKS, "max_blocks"), (ROUTER_MAX_IMBALANCE, "max_imbalance")):
            if parameters.get(param, "") != "":
                try:
                    given[name] = int(parameters[param])
                except ValueError:
                    raise ValueError(f"parameter {param}={parameters[param]!r} is invalid: "
                                     "must be an integer") from None
        return AffinityConfig(block_size=engine.block_size, **given)

    def _blocks(self, parsed: GenerationRequest) -> list[int]:
        """(Route thread.) The prompt's block hashes, tokenized as the engine encodes a prompt;
        none for least-loaded."""
        if self._tokenizer is None:
            return []
        ids = self._tokenizer.encode(parsed.prompt, add_special_tokens=False)
        return block_hashes(ids, self._block_size, parsed.params.cache_salt)

    @staticmethod
    def _joined(flight: _Flight, parsed: GenerationRequest) -> Any:
        """The one answer of a non-streamed request, as the co-located model builds it."""
        text = "".join(flight.text)
        if not parsed.exclude_input:
            text = parsed.prompt + text
        logprobs = parsed.return_log_probs
        return Answer(text, cum_logprob=(flight.cum_logprob or 0.0) if logprobs else None,
                      logprobs=flight.logprobs if logprobs else None,
                      top_logprobs=flight.top_logprobs if parsed.num_top_logprobs else None,
                      **flight.num_tokens, **flight.final).response(pb_utils)

    # -- cancellation --------------------------------------------------------------------------
    def watch(self) -> None:
        """(Response thread.) Flights whose client went away: mark them, let the canceller act.
        A flight whose final response is queued is skipped: only this thread sends it."""
        with self._lock:
            gone = [f for f in self._flights.values()
                    if not f.stopped and not f.final_sent and f.sender.is_cancelled()]
            for flight in gone:
                flight.stopped = True
                self._cancels.put(flight)

    def _cancel_loop(self) -> None:
        while (flight := self._cancels.get()) is not None:
            cancel = flight.cancel
            if cancel is not None:  # the phase model sees the cancel and frees the request's KV
                try:
                    cancel()
                except Exception:  # noqa: BLE001 - the stream already ended
                    pass


def _broken(error: Any) -> bool:
    """A stream's error is the connection's (gRPC status: the server went away), not an error
    response of the model (in-band, no status) nor a cancel."""
    status = error.status() if hasattr(error, "status") else None
    return status is not None and "CANCELLED" not in str(status)


def _urls(text: str) -> list[str]:
    return [u.strip() for u in text.split(",") if u.strip()]


class _PhaseError(Exception):
    def __init__(self, response: Any) -> None:
        super().__init__("phase failed")
        self.response = response
