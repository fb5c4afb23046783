"""Triton python-backend model running a trtforge engine (decoupled, in-flight batching).

Copied into `<repo>/ensemble/1/model.py` by `trtforge emit-repo`. A thin adapter (after
triton-inference-server/vllm_backend):

* `execute()` only parses each request and queues it, then returns: Triton keeps calling it
  while earlier requests are still generating, which is what lets the engine batch them.
* One engine thread owns the engine (it is not thread-safe): it admits queued requests, runs
  `step()`, builds each request's responses, aborts cancelled ones (freeing their KV blocks) and
  updates the metrics. A response thread sends the responses, in order, so the IPC of sending
  overlaps the next step's kernels; a client found gone there is aborted by the engine thread.
* A bad request gets an error response of its own (INVALID_ARG); the others continue. A request
  refused because the waiting queue is full, or aborted past its `timeout_s`, gets UNAVAILABLE
  with a message saying so. (Triton 2.51's HTTP generate endpoints answer 400 whatever the code,
  and gRPC streams carry only the message: the messages are what clients can rely on.) A failing
  `step()` fails the requests in flight, not the model.
* `finalize()` stops accepting work, lets in-flight requests finish (up to
  `finalize_drain_timeout_s`), aborts the rest and joins the thread.

The same file serves the phase models of a disaggregated repository (`phase` parameter, see
model_repo/phases.py): `context` answers with the first token and `context_phase_params` (the KV
handle), `generation` continues from one. The router calls them by gRPC, like any client, so a
cancel reaches them as it reaches the co-located model; they may be pinned to CPU cores (`cpus`).
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from trtforge.model_repo import params as P
from trtforge.model_repo import phases as D
from trtforge.model_repo.interface import INPUTS, PHASE_INPUTS
from trtforge.model_repo.metrics import EngineMetrics
from trtforge.model_repo.request import GenerationRequest, parse_request
from trtforge.model_repo.python_models.responses import error_response, try_send as _try_send
from trtforge.serving.core.scheduler import EngineOverloaded

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
_IDLE_WAIT_S = 0.05  # how long the idle engine thread blocks on the queue before re-checking


@dataclass
class _Active:
    """A request the engine is working on, and what has been sent for it so far."""

    request: GenerationRequest
    sender: Any
    logprobs: list[float] = field(default_factory=list)
    cum_logprob: float = 0.0


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.phase = parameters.get(D.PHASE) or D.BOTH
        D.refuse_other_phase(self.phase, [k for k, v in parameters.items() if v != ""])
        _place_on_cpus(parameters.get(D.CPUS, ""), parameters.get(D.CPU_THREADS, ""))
        from trtforge.serving.engine import LLMEngine  # noqa: PLC0415 - heavy, load-time only

        engine_dir = Path(parameters.get(P.ENGINE_DIR, ""))
        if not parameters.get(P.ENGINE_DIR):
            raise ValueError(f"parameter {P.ENGINE_DIR!r} is missing from config.pbtxt; re-emit "
                             "the repository with `trtforge emit-repo ENGINE_DIR REPO_DIR`.")
        if not engine_dir.is_absolute():
            engine_dir = Path(args["model_repository"]) / engine_dir
        # A bad scheduling value raises here (ConfigError names it and its range): the model then
        # fails to load with that message instead of serving with a setting nobody asked for.
        scheduler = P.scheduler_values(parameters)
        self.engine = LLMEngine.from_engine_dir(
            str(engine_dir), device=parameters.get(P.DEVICE, "cpu") or "cpu",
            kv_cache_memory=parameters.get(P.KV_CACHE_MEMORY) or None, phase=self.phase,
            handoff_timeout_s=float(parameters.get(D.HANDOFF_TIMEOUT) or 30),
            kv_connector=parameters.get(D.KV_CONNECTOR) or "shm",
            kv_advertise_host=parameters.get(D.KV_ADVERTISE_HOST) or None, **scheduler)
        describe = getattr(self.engine.executor, "describe", None)
        if describe is not None:
            pb_utils.Logger.log_info(f"trtforge engine {engine_dir}: {describe()}")
        self.exclude_input_default = P.from_parameter(
            P.EXCLUDE_INPUT_DEFAULT, parameters.get(P.EXCLUDE_INPUT_DEFAULT, "false"), bool)
        self.drain_timeout_s = float(parameters.get(P.DRAIN_TIMEOUT, "5") or 5)
        self.metrics = EngineMetrics(pb_utils, {"model": args["model_name"],
                                                "version": args["model_version"]})
        self._inbox: queue.Queue = queue.Queue()
        self._active: dict[str, _Active] = {}
        self._accepting = True
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards _accepting against execute() during finalize()
        self._next_id = 0
        # Responses go out from their own thread, in order: a send is an IPC round trip to the
        # server, and while the engine thread is inside a kernel (which releases the GIL) the
        # sender thread can do it on the other core instead of adding it to the next step.
        self._outbox: queue.Queue = queue.Queue()
        self._gone: queue.Queue = queue.Queue()  # request ids whose client went away mid-stream
        self._sender_thread = threading.Thread(target=self._send_loop, name="trtforge-responses", daemon=True)
        self._sender_thread.start()
        self._thread = threading.Thread(target=self._engine_loop, name="trtforge-engine",
                                        daemon=True)
        self._thread.start()

    # -- Triton entry points -------------------------------------------------------------------
    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            arrays = _inputs(request)
            try:
                parsed = parse_request(arrays, self.exclude_input_default)
                phase_input = self._phase_input(arrays)
            except (ValueError, TypeError, OverflowError) as exc:
                _send_error(sender, f"bad request: {exc}", "INVALID_ARG")
                continue
            with self._lock:
                if not self._accepting:
                    _send_error(sender, "the model is being unloaded; retry on another instance.",
                                "UNAVAILABLE")
                    continue
                # Arrival is now: a deadline (timeout_s) counts the wait for the engine thread too.
                self._inbox.put(((parsed, phase_input), sender, time.monotonic()))
        return None

    def _phase_input(self, arrays: dict[str, np.ndarray]) -> Any:
        """Check request_type; the generation phase's KVHandle (from context_phase_params)."""
        if self.phase == D.BOTH:
            return None
        kind = arrays.get(D.REQUEST_TYPE)
        want = D.CONTEXT_ONLY if self.phase == D.CONTEXT else D.GENERATION_ONLY
        if kind is not None and _text(kind) != want:
            raise ValueError(f"{D.REQUEST_TYPE}={_text(kind)!r}: the {self.phase} model serves "
                             f"{want} requests only")
        if self.phase == D.CONTEXT:
            return None
        params = arrays.get(D.CONTEXT_PHASE_PARAMS)
        if params is None:
            raise ValueError(f"a generation_only request needs {D.CONTEXT_PHASE_PARAMS} (from the "
                             "context model's response)")
        from trtforge.serving.kv_connector import HandoffError, KVHandle  # noqa: PLC0415

        try:
            return KVHandle.from_json(_text(params))
        except HandoffError as exc:
            raise ValueError(str(exc)) from None

    def finalize(self) -> None:
        with self._lock:
            self._accepting = False
        deadline = time.monotonic() + self.drain_timeout_s
        while time.monotonic() < deadline and (self._active or not self._inbox.empty()):
            time.sleep(0.05)
        self._stop.set()
        self._thread.join(timeout=30)
        self.engine.close()
        self._outbox.put(None)  # after the engine thread's last responses: send them, then stop
        self._sender_thread.join(timeout=30)

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
            for output in self.engine.step():
                self._dispatch(output)
        else:
            self.engine.poll()  # handoffs taken or expired while idle
        self.metrics.update(self.engine.stats())

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
                self._send(None, sender, _error_response(str(exc), "UNAVAILABLE"), FINAL)
            except ValueError as exc:  # prompt too long, bad stop words, …: this request only
                self._send(None, sender, _error_response(f"bad request: {exc}", "INVALID_ARG"), FINAL)
            except RuntimeError as exc:  # a handoff that cannot be taken (HandoffError)
                self._send(None, sender, _error_response(str(exc), "UNAVAILABLE"), FINAL)
            else:
                self._active[request_id] = _Active(parsed, sender)
            item = self._next_item()

    def _next_item(self) -> Any:
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            return None

    def _abort_cancelled(self) -> None:
        while True:  # clients the sender thread found gone
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
            self._send(None, active.sender, None, FINAL)

    def _fail_all(self, message: str) -> None:
        for request_id in list(self._active):
            active = self._active.pop(request_id)
            self.engine.abort(request_id)
            self._send(None, active.sender, _error_response(message), FINAL)

    # -- response thread -----------------------------------------------------------------------
    def _send(self, request_id: str | None, sender: Any, response: Any, flags: int) -> None:
        """Queue a response; request_id (None: nothing to abort) is reported back if the client is gone."""
        self._outbox.put((request_id, sender, response, flags))

    def _send_loop(self) -> None:
        while (item := self._outbox.get()) is not None:
            request_id, sender, response, flags = item
            if not _try_send(sender, response, flags) and request_id is not None:
                self._gone.put(request_id)

    def _dispatch(self, output: Any) -> None:
        active = self._active.get(output.request_id)
        if active is None:  # already answered (aborted or failed)
            return
        if output.error or output.finish_reason in ("error", "abort"):
            self._active.pop(output.request_id)
            code = "UNAVAILABLE" if output.finish_reason == "timeout" else "INTERNAL"
            self._send(None, active.sender,
                       _error_response(output.error or f"request {output.finish_reason}ed", code), FINAL)
            return
        new_logprobs = list(output.logprobs or [])
        active.logprobs.extend(new_logprobs)
        if output.cum_logprob is not None:
            active.cum_logprob = output.cum_logprob
        if output.finished:
            self._active.pop(output.request_id)
            generation = self.phase == D.GENERATION  # its first token came from the context model
            self.metrics.observe_finished(output.metrics, len(output.output_token_ids) - generation,
                                          ttft=not generation)
        response = self._response(active, output, new_logprobs)
        flags = FINAL if output.finished else 0
        if response is not None or flags:
            self._send(None if output.finished else output.request_id, active.sender, response, flags)

    def _response(self, active: _Active, output: Any, new_logprobs: list[float]) -> Any:
        """The response to send for this output, or None if there is nothing to send yet."""
        req = active.request
        if output.kv_handle is not None:  # context phase: the first token and the KV handle
            tensors = [pb_utils.Tensor("text_output", np.array([[output.text_delta.encode("utf-8")]],
                                                               dtype=object)),
                       pb_utils.Tensor(D.CONTEXT_PHASE_PARAMS, np.array(
                           [[output.kv_handle.to_json().encode("utf-8")]], dtype=object))]
            if req.return_log_probs:
                tensors += [pb_utils.Tensor("cum_log_probs", np.array([[active.cum_logprob]], dtype=np.float32)),
                            pb_utils.Tensor("output_log_probs",
                                            np.array([[new_logprobs]], dtype=np.float32).reshape(1, 1, -1))]
            return pb_utils.InferenceResponse(output_tensors=tensors)
        if req.stream:
            if not output.text_delta and not (req.return_log_probs and new_logprobs):
                return None
            text, logprobs = output.text_delta, new_logprobs
        elif not output.finished:
            return None
        else:
            text = output.text if req.exclude_input else req.prompt + output.text
            logprobs = active.logprobs
        tensors = [pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=object))]
        if req.return_log_probs:
            tensors.append(pb_utils.Tensor("cum_log_probs",
                                           np.array([[active.cum_logprob]], dtype=np.float32)))
            tensors.append(pb_utils.Tensor("output_log_probs",
                                           np.array([[logprobs]], dtype=np.float32).reshape(1, 1, -1)))
        if output.finished:
            tensors.append(_int_tensor("num_input_tokens", output.num_prompt_tokens))
            tensors.append(_int_tensor("num_output_tokens", len(output.output_token_ids)))
        return pb_utils.InferenceResponse(output_tensors=tensors)


def _inputs(request: Any) -> dict[str, np.ndarray]:
    arrays = {}
    for spec in INPUTS + PHASE_INPUTS:
        tensor = pb_utils.get_input_tensor_by_name(request, spec.name)
        if tensor is not None:
            arrays[spec.name] = tensor.as_numpy()
    return arrays


def _text(arr: np.ndarray) -> str:
    value = np.asarray(arr).reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _place_on_cpus(cpus: str, threads: str) -> None:
    """Pin this process (and the threads it starts from now on) to `cpus`; size torch's pool."""
    cores = D.parse_cpus(cpus)
    if cores:
        available = os.sched_getaffinity(0)
        if not cores <= available:
            raise ValueError(f"parameter {D.CPUS}={cpus!r}: cores {sorted(cores - available)} are not "
                             f"available to this server (it may use {sorted(available)})")
        os.sched_setaffinity(0, cores)
    n = int(threads) if threads else len(cores)
    if n:
        import torch  # noqa: PLC0415

        torch.set_num_threads(n)


def _int_tensor(name: str, value: int) -> Any:
    return pb_utils.Tensor(name, np.array([[value]], dtype=np.int32))


def _error_response(message: str, code: str = "INTERNAL") -> Any:
    return error_response(pb_utils, message, code)


def _send_error(sender: Any, message: str, code: str = "INTERNAL") -> None:
    _try_send(sender, _error_response(message, code), FINAL)
