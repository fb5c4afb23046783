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

Threads: one per request in flight (the gRPC streams block); ONE response thread that does every
`send` and every `is_cancelled()` check, one after the other (an `is_cancelled()` racing a final
`send` of the same request from another thread is the same crash); and a canceller that cancels
the gRPC stream of a request whose client went away: the phase model frees its KV blocks at once.
A handoff nobody takes (the client left between the phases) is freed by the context model after
`handoff_timeout_s`. A server that has gone away fails the requests it was serving with a
message naming it; what such a request held elsewhere is freed (the context server's handoff by
its deadline, or at once when it was taken).
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from trtforge.model_repo import phases as D
from trtforge.model_repo.interface import INPUTS, OUTPUTS
from trtforge.model_repo.request import parse_request
from trtforge.model_repo.python_models.responses import error_response, try_send as _send

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
_WATCH_S = 0.02  # how often the watcher looks for cancelled clients
_OUTPUT_NAMES = [s.name for s in OUTPUTS] + [D.CONTEXT_PHASE_PARAMS]


@dataclass
class _Flight:
    """A request being routed: its client, and the phase model now serving it."""

    sender: Any
    model: str
    stopped: bool = False
    text: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cum_logprob: float | None = None
    num_tokens: dict[str, int] = field(default_factory=dict)
    cancel: Any = None
    """Remote phase: cancels its gRPC stream (the server frees the request's KV)."""
    last: Any = None
    """A streamed client's last response, held until the phase's BLS stream has ended."""
    final_sent: bool = False
    """The client got its final response: its sender must not be touched again (Triton 2.51
    crashes in ResponseFactoryIsCancelled on a completed request)."""


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.context_model = parameters.get(D.CONTEXT_MODEL) or D.CONTEXT
        self.generation_model = parameters.get(D.GENERATION_MODEL) or D.GENERATION
        self.exclude_input_default = parameters.get("exclude_input_in_output", "false") == "true"
        here = os.environ.get("TRTFORGE_TRITON_GRPC_URL") or "127.0.0.1:8001"
        self.urls = {D.CONTEXT: _urls(parameters.get(D.CONTEXT_URLS, "")) or [here],
                     D.GENERATION: _urls(parameters.get(D.GENERATION_URLS, "")) or [here]}
        self._load = {url: 0 for urls in self.urls.values() for url in urls}  # requests in flight
        self._flights: dict[str, _Flight] = {}
        self._lock = threading.Lock()
        self._accepting = True
        self._done = threading.Event()
        self._cancels: queue.Queue = queue.Queue()  # (key, flight, model) found cancelled
        self._watcher = threading.Thread(target=self._cancel_loop, name="trtforge-router-cancel",
                                         daemon=True)
        self._watcher.start()
        self._outbox: queue.Queue = queue.Queue()
        self._sender = threading.Thread(target=self._send_loop, name="trtforge-router-send", daemon=True)
        self._sender.start()

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            # Copies, taken now: the request's own tensors belong to it, and a BLS request made
            # from them would release them when it ends (Triton's heap then fails under load).
            inputs = {t.name(): np.array(t.as_numpy(), copy=True) for t in request.inputs()
                      if t.name() in _INPUT_NAMES}
            try:
                parsed = parse_request(inputs, self.exclude_input_default)
            except (ValueError, TypeError, OverflowError) as exc:
                self._outbox.put((sender, _error(f"bad request: {exc}", "INVALID_ARG"), FINAL))
                continue
            with self._lock:
                if not self._accepting:
                    self._outbox.put((sender, _error("the model is being unloaded; retry on another "
                                                     "instance.", "UNAVAILABLE"), FINAL))
                    continue
                key = uuid.uuid4().hex
                self._flights[key] = _Flight(sender, self.context_model)
            threading.Thread(target=self._route, args=(key, parsed, inputs), daemon=True,
                             name=f"trtforge-route-{key[:8]}").start()
        return None

    def finalize(self) -> None:
        with self._lock:
            self._accepting = False
        deadline = time.monotonic() + 10
        while self._flights and time.monotonic() < deadline:
            time.sleep(0.05)
        self._done.set()
        self._cancels.put(None)
        self._watcher.join(timeout=5)
        self._outbox.put(None)
        self._sender.join(timeout=5)

    def _send_loop(self) -> None:
        """Send responses in order; every _WATCH_S look for clients that went away."""
        next_scan = time.monotonic() + _WATCH_S
        while True:
            try:
                item = self._outbox.get(timeout=max(0.0, next_scan - time.monotonic()))
            except queue.Empty:
                item = ()
            if item is None:
                return
            if item:
                _send(*item)
            if time.monotonic() >= next_scan:
                self._scan_cancelled()
                next_scan = time.monotonic() + _WATCH_S

    # -- one request ---------------------------------------------------------------------------
    def _route(self, key: str, parsed: Any, inputs: dict[str, Any]) -> None:
        flight = self._flights[key]
        try:
            handle = self._phase(key, flight, parsed, self.context_model, inputs,
                                 D.CONTEXT_ONLY, None)
            with self._lock:  # the watcher reads `stopped` and `model` together
                go = handle is not None and not flight.stopped
                if go:
                    flight.model = self.generation_model
            if go:
                self._phase(key, flight, parsed, self.generation_model, inputs,
                            D.GENERATION_ONLY, handle)
            if not parsed.stream and not flight.stopped and flight.num_tokens:
                self._final(flight, self._joined(flight, parsed))  # one response, as co-located
            else:
                self._final(flight, flight.last)
        except _PhaseError as exc:
            self._final(flight, exc.response)
        except Exception as exc:  # noqa: BLE001 - answer the client whatever went wrong
            self._final(flight, _error(f"routing failed: {type(exc).__name__}: {exc}"))
        finally:
            with self._lock:
                self._flights.pop(key, None)

    def _final(self, flight: _Flight, response: Any) -> None:
        """Send the client's last response (once): first take it off the watcher's list."""
        with self._lock:
            if flight.final_sent:
                return
            flight.final_sent = True
        self._outbox.put((flight.sender, response, FINAL))

    def _phase(self, key: str, flight: _Flight, parsed: Any, model: str, inputs: dict[str, np.ndarray],
               request_type: str, handle: bytes | None) -> bytes | None:
        """Run one phase, forwarding (or collecting) its deltas; the context phase's handle."""
        arrays = {name: a for name, a in inputs.items() if name not in ("stream", "exclude_input_in_output")}
        arrays.update({"stream": np.array([[True]]), "exclude_input_in_output": np.array([[True]]),
                       D.REQUEST_TYPE: np.array([[request_type.encode()]], dtype=object)})
        if handle is not None:
            arrays[D.CONTEXT_PHASE_PARAMS] = np.array([[handle]], dtype=object)
        kind = D.CONTEXT if request_type == D.CONTEXT_ONLY else D.GENERATION
        handed = None
        for outputs in self._stream(flight, kind, model, arrays, key):
            if D.CONTEXT_PHASE_PARAMS in outputs:
                handed = outputs.pop(D.CONTEXT_PHASE_PARAMS).reshape(-1)[0]
            self._forward(flight, parsed, outputs)
        return handed

    def _stream(self, flight: _Flight, kind: str, model: str, arrays: dict[str, np.ndarray], key: str):
        """One phase: a gRPC stream to the least-loaded server of that kind; its outputs as arrays."""
        import tritonclient.grpc as grpcclient  # noqa: PLC0415

        from trtforge.model_repo.client import infer_inputs  # noqa: PLC0415

        with self._lock:
            url = min(self.urls[kind], key=lambda u: self._load[u])
            self._load[url] += 1
        responses: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(url)
        finished = False
        try:
            try:
                client.start_stream(callback=lambda result, error: responses.put((result, error)))
                flight.cancel = lambda: client.stop_stream(cancel_requests=True)
                client.async_stream_infer(model, infer_inputs(arrays),
                                          request_id=key, enable_empty_final_response=True)
            except Exception as exc:  # noqa: BLE001 - unreachable, gone: this request fails
                finished = True
                raise _PhaseError(_error(f"the {kind} server {url} failed this request: {exc}",
                                         "UNAVAILABLE")) from None
            while not finished:
                if flight.stopped:  # cancelled by the client: the finally cancels the stream
                    raise _PhaseError(_error("the request was cancelled", "UNAVAILABLE"))
                try:
                    result, error = responses.get(timeout=0.5)
                except queue.Empty:
                    if flight.stopped:  # cancelled: the stream may end without a word
                        raise _PhaseError(_error("the request was cancelled", "UNAVAILABLE")) from None
                    continue
                if error is not None:
                    finished = True
                    raise _PhaseError(_error(f"the {kind} server {url} failed this request: {error}",
                                             "UNAVAILABLE"))
                finished = result.get_response().parameters["triton_final_response"].bool_param
                outputs = {n: result.as_numpy(n) for n in _OUTPUT_NAMES}
                outputs = {n: a for n, a in outputs.items() if a is not None}
                if outputs:
                    yield outputs
        finally:
            flight.cancel = None
            try:
                client.stop_stream(cancel_requests=not finished)
                client.close()
            except Exception:  # noqa: BLE001 - already closed by a cancel
                pass
            with self._lock:
                self._load[url] -= 1

    def _forward(self, flight: _Flight, parsed: Any, outputs: dict[str, np.ndarray]) -> None:
        text = outputs["text_output"].reshape(-1)[0] if "text_output" in outputs else b""
        text = text.decode("utf-8") if isinstance(text, bytes) else str(text)
        new_logprobs = (outputs["output_log_probs"].reshape(-1).tolist()
                        if "output_log_probs" in outputs else [])
        if "cum_log_probs" in outputs:
            flight.cum_logprob = float(outputs["cum_log_probs"].reshape(-1)[0])
        for name in ("num_input_tokens", "num_output_tokens"):
            if name in outputs:
                flight.num_tokens[name] = int(outputs[name].reshape(-1)[0])
        flight.text.append(text)
        flight.logprobs += new_logprobs
        if parsed.stream and (text or new_logprobs or "num_output_tokens" in outputs):
            names = [n for n in ("text_output", "cum_log_probs", "output_log_probs",
                                 "num_input_tokens", "num_output_tokens") if n in outputs]
            tensors = [pb_utils.Tensor(n, outputs[n]) for n in names]
            response = pb_utils.InferenceResponse(output_tensors=tensors)
            if "num_output_tokens" in outputs:  # the phase model's last answer: sent with FINAL
                flight.last = response            # once its BLS stream has ended (_route)
            else:
                self._outbox.put((flight.sender, response, 0))

    @staticmethod
    def _joined(flight: _Flight, parsed: Any) -> Any:
        """The one answer of a non-streamed request, as the co-located model builds it."""
        text = "".join(flight.text)
        if not parsed.exclude_input:
            text = parsed.prompt + text
        tensors = [pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=object))]
        if parsed.return_log_probs:
            tensors.append(pb_utils.Tensor("cum_log_probs", np.array([[flight.cum_logprob or 0.0]],
                                                                     dtype=np.float32)))
            tensors.append(pb_utils.Tensor("output_log_probs", np.array(
                [[flight.logprobs]], dtype=np.float32).reshape(1, 1, -1)))
        for name, value in flight.num_tokens.items():
            tensors.append(pb_utils.Tensor(name, np.array([[value]], dtype=np.int32)))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    # -- cancellation --------------------------------------------------------------------------
    def _scan_cancelled(self) -> None:
        """(Response thread.) Flights whose client went away: mark them, let the canceller act.
        A flight whose final response is queued is skipped: only this thread sends it."""
        with self._lock:
            gone = [(k, f) for k, f in self._flights.items()
                    if not f.stopped and not f.final_sent and f.sender.is_cancelled()]
            for key, flight in gone:
                flight.stopped = True
                self._cancels.put((key, flight, flight.model))

    def _cancel_loop(self) -> None:
        while (item := self._cancels.get()) is not None:
            key, flight, model = item
            cancel = flight.cancel
            if cancel is not None:  # the phase model sees the cancel and frees the request's KV
                try:
                    cancel()
                except Exception:  # noqa: BLE001 - the stream already ended
                    pass


_INPUT_NAMES = {s.name for s in INPUTS}


def _urls(text: str) -> list[str]:
    return [u.strip() for u in text.split(",") if u.strip()]


class _PhaseError(Exception):
    def __init__(self, response: Any) -> None:
        super().__init__("phase failed")
        self.response = response


def _bool(name: str, value: bool) -> Any:
    return pb_utils.Tensor(name, np.array([[value]], dtype=bool))


def _bytes(name: str, value: bytes) -> Any:
    return pb_utils.Tensor(name, np.array([[value]], dtype=object))


def _error(message: str, code: str = "INTERNAL") -> Any:
    return error_response(pb_utils, message, code)
