"""Triton python-backend model running a trtforge engine (decoupled, in-flight batching).

Copied into `<repo>/ensemble/1/model.py` by `trtforge emit-repo`. A thin adapter (after
triton-inference-server/vllm_backend):

* `execute()` only parses each request and queues it, then returns: Triton keeps calling it
  while earlier requests are still generating, which is what lets the engine batch them.
* One engine thread owns the engine (it is not thread-safe): it admits queued requests, runs
  `step()`, builds each request's responses, aborts cancelled ones (freeing their KV blocks) and
  updates the metrics. The response thread (base.py) sends the responses, in order, so the IPC of
  sending overlaps the next step's kernels; a client found gone there is aborted by the engine
  thread. The engine thread checks `is_cancelled()` only for requests whose final response is not
  queued yet (a finished request leaves `_active` first).
* A bad request gets an error response of its own (INVALID_ARG); the others continue. A request
  refused because the waiting queue is full, or aborted past its `timeout_s`, gets UNAVAILABLE
  with a message saying so. (Triton 2.51's HTTP generate endpoints answer 400 whatever the code,
  and gRPC streams carry only the message: the messages are what clients can rely on.) A failing
  `step()` fails the requests in flight, not the model.
* `finalize()` stops accepting work, lets in-flight requests finish (up to
  `finalize_drain_timeout_s`), aborts the rest and joins the threads.

The parameters in config.pbtxt are fields of RuntimeConfig (device, kv_cache_memory, phase, …),
of SchedulerConfig, and the adapter's own (params.AdapterOptions); a bad one fails the load,
naming it.

The same file serves the phase models of a disaggregated repository (`phase` parameter, see
model_repo/phases.py): `context` answers with the first token and `context_phase_params` (the KV
handle), `generation` continues from one. The router calls them by gRPC, like any client, so a
cancel reaches them as it reaches the co-located model; they may be pinned to CPU cores (`cpus`).
The phase models refuse `prompt_logprobs` (INVALID_ARG, by name): the router forwards only the
outputs of the generated tokens.

Prompt logprobs (`prompt_logprobs` = K) go out once, with the first response sent after the engine
computed them (a stream's first; the only response otherwise): `prompt_log_probs`,
`prompt_logprob_ranks`, `prompt_top_logprobs_ids` / `prompt_top_logprobs` (interface.py).

Speculative decoding (the `speculative_config` parameter, else engine.json's default): the input
`speculative` = false opts a request out; the last response of every request carries TensorRT-LLM's
`total_draft_tokens`, `total_accepted_draft_tokens` and `acceptance_rate`, and
`avg_decoded_tokens_per_iter` (its tokens per engine step that gave it any, counted here).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from trtforge.config.runtime import Phase
from trtforge.model_repo.metrics import EngineMetrics
from trtforge.model_repo.params import ENGINE_DIR, AdapterOptions, runtime_config, scheduler_values
from trtforge.model_repo.phases import (
    CONTEXT_PHASE_PARAMS,
    CPU_THREADS,
    CPUS,
    REQUEST_TYPE,
    RequestType,
    parse_cpus,
    refuse_other_phase,
)
from trtforge.model_repo.python_models.base import (
    PHASE_MODEL_INPUTS,
    Answer,
    DecoupledModel,
    model_parameters,
    text_of,
)
from trtforge.model_repo.request import GenerationRequest, parse_request
from trtforge.model_repo.speculation import speculation_arrays, with_speculative_input
from trtforge.serving.core.scheduler import EngineOverloaded
from trtforge.serving.outputs import FinishReason

_IDLE_WAIT_S = 0.05  # how long the idle engine thread blocks on the queue before re-checking


@dataclass
class _Active:
    """A request the engine is working on, and what has been sent for it so far."""

    request: GenerationRequest
    sender: Any
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    cum_logprob: float = 0.0
    prompt_logprobs: list[Any] | None = None
    """The engine's prompt logprobs, not sent yet (serving/prompt_logprobs.PromptLogprob)."""
    steps: int = 0
    """Engine steps that gave the request tokens (avg_decoded_tokens_per_iter's denominator)."""
    last_step: int = -1


class TritonPythonModel(DecoupledModel):
    def initialize(self, args: dict[str, str]) -> None:
        parameters = model_parameters(args)
        # A bad value raises here (naming it and its range): the model then fails to load with
        # that message instead of serving with a setting nobody asked for.
        runtime = runtime_config(parameters)
        options = AdapterOptions.from_parameters(parameters)
        self.phase = runtime.phase
        refuse_other_phase(self.phase, [k for k, v in parameters.items() if v != ""])
        _place_on_cpus(parameters.get(CPUS, ""), parameters.get(CPU_THREADS, ""))
        from trtforge.serving.engine import LLMEngine  # heavy, load-time only

        if not options.engine_dir:
            raise ValueError(f"parameter {ENGINE_DIR!r} is missing from config.pbtxt; re-emit "
                             "the repository with `trtforge emit-repo ENGINE_DIR REPO_DIR`.")
        engine_dir = Path(options.engine_dir)
        if not engine_dir.is_absolute():
            engine_dir = Path(args["model_repository"]) / engine_dir
        self.engine = LLMEngine.from_engine_dir(str(engine_dir), runtime,
                                                **scheduler_values(parameters))
        describe = getattr(self.engine.executor, "describe", None)
        if describe is not None:
            pb_utils.Logger.log_info(f"trtforge engine {engine_dir}: {describe()}")
        self._kv_events = self._kv_event_publisher(options.kv_events_endpoint)
        self.exclude_input_default = options.exclude_input_in_output
        self.drain_timeout_s = options.finalize_drain_timeout_s
        self.metrics = EngineMetrics(pb_utils, {"model": args["model_name"],
                                                "version": args["model_version"]})
        self._inbox: queue.Queue = queue.Queue()
        self._active: dict[str, _Active] = {}
        self._next_id = 0
        self._step = 0  # engine steps run (to count each request's steps)
        self._gone: queue.Queue = queue.Queue()  # request ids whose client went away mid-stream
        self.start_responses(pb_utils, "trtforge-responses")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._engine_loop, name="trtforge-engine",
                                        daemon=True)
        self._thread.start()

    # -- Triton entry points -------------------------------------------------------------------
    def execute(self, requests: list[Any]) -> None:
        self.intake(requests, PHASE_MODEL_INPUTS, self._parse, self._accept)

    def _parse(self, arrays: dict[str, np.ndarray]) -> tuple[Any, Any]:
        parsed = with_speculative_input(parse_request(arrays, self.exclude_input_default), arrays)
        if parsed.prompt_logprobs is not None and self.phase != Phase.BOTH:
            raise ValueError(f"prompt_logprobs={parsed.prompt_logprobs} is not supported by a disaggregated "
                             f"repository (this is its {self.phase} model): the router forwards the "
                             "generated tokens' outputs only; serve the model co-located for prompt logprobs")
        return parsed, self._phase_input(arrays)

    def _accept(self, sender: Any, parsed: tuple[Any, Any], arrays: dict[str, np.ndarray]) -> None:
        # Arrival is now: a deadline (timeout_s) counts the wait for the engine thread too.
        self._inbox.put((parsed, sender, time.monotonic()))

    def _phase_input(self, arrays: dict[str, np.ndarray]) -> Any:
        """Check request_type; the generation phase's KVHandle (from context_phase_params)."""
        if self.phase == Phase.BOTH:
            return None
        kind = arrays.get(REQUEST_TYPE)
        want = RequestType.of(self.phase)
        if kind is not None and text_of(kind) != want:
            raise ValueError(f"{REQUEST_TYPE}={text_of(kind)!r}: the {self.phase} model serves "
                             f"{want} requests only")
        if self.phase == Phase.CONTEXT:
            return None
        params = arrays.get(CONTEXT_PHASE_PARAMS)
        if params is None:
            raise ValueError(f"a {RequestType.GENERATION_ONLY} request needs {CONTEXT_PHASE_PARAMS} "
                             "(from the context model's response)")
        from trtforge.serving.kv_connector import HandoffError, KVHandle

        try:
            return KVHandle.from_json(text_of(params))
        except HandoffError as exc:
            raise ValueError(str(exc)) from None

    def finalize(self) -> None:
        self.drain(self.drain_timeout_s, lambda: bool(self._active) or not self._inbox.empty())
        self._stop.set()
        self._thread.join(timeout=30)
        self.engine.close()
        if self._kv_events is not None:
            self._kv_events[1].close()
        self.stop_responses(timeout_s=30)  # after the engine thread's last responses

    # -- engine thread -------------------------------------------------------------------------
    def _engine_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._iteration()
            except Exception as exc:  # noqa: BLE001 - fail the requests, keep the model up
                # A dead loop would leave every client waiting forever: answer them instead.
                pb_utils.Logger.log_error(f"trtforge engine loop: {type(exc).__name__}: {exc}")
                self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
        self._fail_all("the model was unloaded before this request finished.")

    def _iteration(self) -> None:
        self._admit(block=not self.engine.has_unfinished())
        self._abort_cancelled()
        if self.engine.has_unfinished():
            self._step += 1
            for output in self.engine.step():
                self._dispatch(output)
        else:
            self.engine.poll()  # handoffs taken or expired while idle
        if self._kv_events is not None:
            self._kv_events[1].publish(self._kv_events[0].drain())
        self.metrics.update(self.engine.stats())

    def _kv_event_publisher(self, endpoint: str) -> Any:
        """(the KV manager's event log, the ZMQ publisher) when kv_events_endpoint is set."""
        if not endpoint:
            return None
        from trtforge.serving.kv_events_zmq import ZmqKVEventPublisher

        publisher = ZmqKVEventPublisher(endpoint, self.engine.scheduler_config.block_size)
        pb_utils.Logger.log_info(f"trtforge KV events (vLLM's ZMQ format) on {publisher.endpoint}")
        return self.engine.scheduler.kv_manager.enable_events(), publisher

    def _admit(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=_IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            (parsed, handle), sender, arrived = item
            self._next_id += 1
            request_id = f"triton-{self._next_id}"
            try:
                if handle is not None:
                    self.engine.add_handoff(handle, parsed.params, request_id=request_id,
                                            arrival_time=arrived)
                else:
                    self.engine.add_request(parsed.prompt, parsed.params, request_id=request_id,
                                            arrival_time=arrived)
            except EngineOverloaded as exc:  # the waiting queue is full: refused now, not queued
                self.send_error(sender, str(exc), "UNAVAILABLE")
            except ValueError as exc:  # prompt too long, bad stop words, …: this request only
                self.send_error(sender, f"bad request: {exc}", "INVALID_ARG")
            except RuntimeError as exc:  # a handoff that cannot be taken (HandoffError)
                self.send_error(sender, str(exc), "UNAVAILABLE")
            else:
                self._active[request_id] = _Active(parsed, sender)
            item = self._next_item()

    def _next_item(self) -> Any:
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            return None

    def _abort_cancelled(self) -> None:
        while True:  # clients the response thread found gone
            try:
                self._abort(self._gone.get_nowait(), send_final=False)
            except queue.Empty:
                break
        for request_id, active in list(self._active.items()):
            if active.sender.is_cancelled():
                self._abort(request_id, send_final=True)

    def _abort(self, request_id: str, send_final: bool) -> None:
        active = self._active.pop(request_id, None)
        self.engine.abort(request_id)  # frees its KV blocks now
        if active is not None and send_final:
            self.send(active.sender, None, self.final)

    def _fail_all(self, message: str) -> None:
        for request_id in list(self._active):
            active = self._active.pop(request_id)
            self.engine.abort(request_id)
            self.send_error(active.sender, message)

    def client_gone(self, gone: Any) -> None:
        self._gone.put(gone)  # aborted by the engine thread: only it touches the engine

    def _dispatch(self, output: Any) -> None:
        active = self._active.get(output.request_id)
        if active is None:  # already answered (aborted or failed)
            return
        if output.error or output.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
            self._active.pop(output.request_id)
            code = "UNAVAILABLE" if output.finish_reason == FinishReason.TIMEOUT else "INTERNAL"
            self.send_error(active.sender, output.error or f"request {output.finish_reason}ed", code)
            return
        new_logprobs = list(output.logprobs or [])
        if output.prompt_logprobs is not None:
            active.prompt_logprobs = output.prompt_logprobs
        active.logprobs.extend(new_logprobs)
        active.top_logprobs.extend(output.top_logprobs or [])
        if output.new_token_ids and active.last_step != self._step:
            active.steps, active.last_step = active.steps + 1, self._step
        if output.cum_logprob is not None:
            active.cum_logprob = output.cum_logprob
        if output.finished:
            self._active.pop(output.request_id)
            generation = self.phase == Phase.GENERATION  # its first token came from the context model
            self.metrics.observe_finished(output.metrics, len(output.output_token_ids) - generation,
                                          ttft=not generation)
        answer = self._answer(active, output, new_logprobs)
        flags = self.final if output.finished else 0
        if answer is not None or flags:
            response = None if answer is None else self._response(active, answer, output)
            self.send(active.sender, response, flags, gone=None if output.finished else output.request_id)

    def _answer(self, active: _Active, output: Any, new_logprobs: list[float]) -> Answer | None:
        """What to send for this output, or None if there is nothing to send yet. A streamed
        request's last output is always answered: it carries the counts and why it finished."""
        req = active.request
        new_tops = list(output.top_logprobs or [])
        if output.kv_handle is not None:  # context phase: the first token and the KV handle
            text, logprobs, tops = output.text_delta, new_logprobs, new_tops
            final = {"num_cached_tokens": output.num_cached_tokens}  # the router puts it on the last response
        elif req.stream:
            if not output.finished and not output.text_delta and not (req.return_log_probs and new_logprobs) \
                    and active.prompt_logprobs is None:
                return None
            text, logprobs, tops = output.text_delta, new_logprobs, new_tops
            final = _final_fields(output) if output.finished else {}
        elif not output.finished:
            return None
        else:
            text = output.text if req.exclude_input else req.prompt + output.text
            logprobs, tops, final = active.logprobs, active.top_logprobs, _final_fields(output)
        return Answer(text, **final,
                      cum_logprob=active.cum_logprob if req.return_log_probs else None,
                      logprobs=logprobs if req.return_log_probs else None,
                      top_logprobs=tops if req.num_top_logprobs else None,
                      context_phase_params=(output.kv_handle.to_json().encode("utf-8")
                                            if output.kv_handle is not None else None))


    def _response(self, active: _Active, answer: Answer, output: Any) -> Any:
        """The response of `answer`, with the prompt logprobs if they are still to be sent, and on
        a request's last response the speculative decoding counts of an engine that speculates."""
        tensors = answer.tensors(pb_utils)
        if active.prompt_logprobs is not None:
            entries, active.prompt_logprobs = active.prompt_logprobs, None
            tensors += [pb_utils.Tensor(name, array) for name, array in prompt_logprob_arrays(
                entries, active.request.prompt_logprobs or 0).items()]
        if output.finished and output.kv_handle is None and self.engine.spec is not None:
            generated = len(output.output_token_ids) - (self.phase == Phase.GENERATION)  # its first: the context's
            tensors += [pb_utils.Tensor(name, array) for name, array in speculation_arrays(
                output.num_draft_tokens, output.num_accepted_tokens, generated, active.steps).items()]
        return pb_utils.InferenceResponse(output_tensors=tensors)


def prompt_logprob_arrays(entries: list[Any], k: int) -> dict[str, np.ndarray]:
    """The prompt logprob outputs (with the batch dimension) of the engine's entries, one per
    prompt token after the first: [1, P-1] logprobs and ranks, [1, P-1, K] alternatives (none
    when K is 0; nothing for a one-token prompt: no empty tensors)."""
    n = len(entries)
    if n == 0:
        return {}
    arrays = {"prompt_log_probs": np.array([e.logprob for e in entries], dtype=np.float32).reshape(1, n),
              "prompt_logprob_ranks": np.array([e.rank for e in entries], dtype=np.int32).reshape(1, n)}
    if k == 0:
        return arrays
    ids = np.zeros((1, n, k), dtype=np.int32)
    values = np.full((1, n, k), -np.inf, dtype=np.float32)
    for i, e in enumerate(entries):
        ids[0, i, :len(e.top)] = [t for t, _ in e.top]
        values[0, i, :len(e.top)] = [v for _, v in e.top]
    return {**arrays, "prompt_top_logprobs_ids": ids, "prompt_top_logprobs": values}


def _final_fields(output: Any) -> dict[str, Any]:
    """A finished request's counts and why it finished (its last response carries them)."""
    reason = output.stop_reason
    return {"num_input_tokens": output.num_prompt_tokens,
            "num_output_tokens": len(output.output_token_ids),
            "num_cached_tokens": output.num_cached_tokens,
            "finish_reason": str(output.finish_reason),
            "stop_reason": reason if isinstance(reason, str) else None,
            "stop_token_id": reason if isinstance(reason, int) and not isinstance(reason, bool) else None}


def _place_on_cpus(cpus: str, threads: str) -> None:
    """Pin this process (and the threads it starts from now on) to `cpus`; size torch's pool."""
    cores = parse_cpus(cpus)
    if cores:
        available = os.sched_getaffinity(0)
        if not cores <= available:
            raise ValueError(f"parameter {CPUS}={cpus!r}: cores {sorted(cores - available)} are not "
                             f"available to this server (it may use {sorted(available)})")
        os.sched_setaffinity(0, cores)
    n = int(threads) if threads else len(cores)
    if n:
        import torch

        torch.set_num_threads(n)
