"""What the two python-backend models (engine.py, router.py) share: the output tensors of the
`ensemble` interface, error responses, refusing requests while unloading, and the response thread.

pb_utils (triton_python_backend_utils) only exists inside Triton's python-backend stub: the models
import it there and hand it in (`DecoupledModel.start_responses`); nothing here imports it.

Threads: a model's own threads (Triton's `execute()`, the engine thread, the router's route
threads) only queue responses (`send`). ONE response thread sends them, in order (a send is an IPC
round trip to the server: queued, it overlaps the sender's next work), and between sends it calls
`watch()` every `watch_s` seconds, where a model may look for clients that went away: an
`is_cancelled()` racing a final `send` of the same request from another thread crashes Triton
2.51's python backend (heap corruption in ResponseFactoryIsCancelled), and on this thread the two
never overlap. A model that checks `is_cancelled()` on another thread must stop checking a request
before queuing its final response.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from trtforge.model_repo.interface import INPUTS, PHASE_INPUTS
from trtforge.model_repo.phases import CONTEXT_PHASE_PARAMS

INTERFACE_INPUTS = frozenset(s.name for s in INPUTS)
"""The inputs of the `ensemble` interface."""
PHASE_MODEL_INPUTS = INTERFACE_INPUTS | {s.name for s in PHASE_INPUTS}
"""The inputs of a `context` or `generation` model."""


TopLogprobs = list[list[tuple[int, float]]]
"""Per token, its most likely (token id, log-probability) pairs, most likely first."""


@dataclass
class Answer:
    """The output tensors of one response (interface.OUTPUTS, and a context model's
    context_phase_params), as values; None leaves a tensor out."""

    text: str
    cum_logprob: float | None = None
    logprobs: list[float] | None = None
    """Log-probabilities of the tokens this response covers."""
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    context_phase_params: bytes | None = None
    top_logprobs: TopLogprobs | None = None
    """The tokens this response covers: each one's `num_top_logprobs` alternatives
    (top_logprobs_ids / top_logprobs, [1, n, K])."""
    finish_reason: str | None = None
    """The last response: stop | length."""
    stop_reason: str | None = None
    """The last response of a request ended by a stop string: that string."""
    stop_token_id: int | None = None
    """The last response of a request ended by a stop token (EOS, end_id): that token."""
    num_cached_tokens: int | None = None
    """The last response (and a context model's handoff): prompt tokens served from the prefix cache."""

    def tensors(self, pb_utils: Any) -> list[Any]:
        t = pb_utils.Tensor
        tensors = [t("text_output", np.array([[self.text.encode("utf-8")]], dtype=object))]
        if self.context_phase_params is not None:
            tensors.append(t(CONTEXT_PHASE_PARAMS, np.array([[self.context_phase_params]], dtype=object)))
        if self.cum_logprob is not None:
            tensors.append(t("cum_log_probs", np.array([[self.cum_logprob]], dtype=np.float32)))
        if self.logprobs is not None:
            tensors.append(t("output_log_probs",
                             np.array([[self.logprobs]], dtype=np.float32).reshape(1, 1, -1)))
        if self.top_logprobs is not None:
            k = max((len(row) for row in self.top_logprobs), default=0)
            ids = np.zeros((1, len(self.top_logprobs), k), dtype=np.int32)
            values = np.full((1, len(self.top_logprobs), k), -np.inf, dtype=np.float32)
            for i, row in enumerate(self.top_logprobs):  # every row has K entries (the request's)
                ids[0, i, :len(row)] = [tid for tid, _ in row]
                values[0, i, :len(row)] = [lp for _, lp in row]
            tensors += [t("top_logprobs_ids", ids), t("top_logprobs", values)]
        for name in ("finish_reason", "stop_reason"):
            value = getattr(self, name)
            if value is not None:
                tensors.append(t(name, np.array([[value.encode("utf-8")]], dtype=object)))
        for name in ("num_input_tokens", "num_output_tokens", "stop_token_id", "num_cached_tokens"):
            value = getattr(self, name)
            if value is not None:
                tensors.append(t(name, np.array([[value]], dtype=np.int32)))
        return tensors

    def response(self, pb_utils: Any) -> Any:
        return pb_utils.InferenceResponse(output_tensors=self.tensors(pb_utils))

    @classmethod
    def of_arrays(cls, arrays: Mapping[str, np.ndarray]) -> Answer:
        """What a response's output arrays (as a client receives them) say."""
        def first(name: str) -> Any:
            return arrays[name].reshape(-1)[0] if name in arrays and arrays[name].size else None

        text = first("text_output")
        handle = first(CONTEXT_PHASE_PARAMS)
        ints = {n: int(first(n)) for n in ("num_input_tokens", "num_output_tokens", "stop_token_id",
                                           "num_cached_tokens") if first(n) is not None}
        strings = {n: _str(first(n)) for n in ("finish_reason", "stop_reason") if first(n) is not None}
        return cls(text=_str(text) if text is not None else "",
                   cum_logprob=float(first("cum_log_probs")) if first("cum_log_probs") is not None else None,
                   logprobs=(arrays["output_log_probs"].reshape(-1).tolist()
                             if "output_log_probs" in arrays else None),
                   context_phase_params=None if handle is None else bytes(handle),
                   top_logprobs=top_logprobs_of(arrays), **ints, **strings)


def top_logprobs_of(arrays: Mapping[str, np.ndarray]) -> TopLogprobs | None:
    """top_logprobs_ids / top_logprobs ([1, n, K] or [n, K]) as pairs per token; None if absent."""
    if "top_logprobs_ids" not in arrays or "top_logprobs" not in arrays:
        return None
    ids, values = np.asarray(arrays["top_logprobs_ids"]), np.asarray(arrays["top_logprobs"])
    if ids.ndim == 3:
        ids, values = ids[0], values[0]
    return [list(zip(map(int, row_ids), map(float, row_values))) for row_ids, row_values in zip(ids, values)]


def _str(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def model_parameters(args: dict[str, str]) -> dict[str, str]:
    """{name: string_value} of the config.pbtxt parameters of the model initialize() loads."""
    config = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in config.get("parameters", {}).items()}


def input_arrays(request: Any, names: frozenset[str]) -> dict[str, np.ndarray]:
    """Copies of the request's input arrays named in `names`: a model may read them after
    execute() has returned, when the request's own tensors may be gone."""
    return {t.name(): np.array(t.as_numpy(), copy=True) for t in request.inputs()
            if t.name() in names}


def text_of(array: np.ndarray) -> str:
    """The one string of a [1] / [1, 1] string tensor."""
    return _str(np.asarray(array).reshape(-1)[0])


def error_response(pb_utils: Any, message: str, code: str = "INTERNAL") -> Any:
    """An error response; `code` names a pb_utils.TritonError code (INVALID_ARG, UNAVAILABLE, …)."""
    error = pb_utils.TritonError(message, getattr(pb_utils.TritonError, code))
    return pb_utils.InferenceResponse(error=error)


def try_send(sender: Any, response: Any, flags: int) -> bool:
    """Send; False when the client has gone away (Triton raises for a cancelled request)."""
    try:
        if response is None:
            sender.send(flags=flags)
        else:
            sender.send(response, flags=flags)
        return True
    except Exception:  # noqa: BLE001 - pb_utils raises TritonModelException for closed streams
        return False


class DecoupledModel:
    """A decoupled python-backend model's admission and response thread (see the module doc).

    `initialize()` calls `start_responses` first; `execute()` refuses a request with
    `refuse_if_unloading` (holding `_lock`, under which it also registers what it accepts);
    `finalize()` calls `drain`, stops its own threads, then `stop_responses`."""

    watch_s: float | None = None
    """How often the response thread calls `watch()` between sends (None: never)."""

    def start_responses(self, pb_utils: Any, thread_name: str) -> None:
        self.pb_utils = pb_utils
        self.final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        self._lock = threading.Lock()  # guards _accepting against execute() during finalize()
        self._accepting = True
        self._outbox: queue.Queue = queue.Queue()
        self._sender_thread = threading.Thread(target=self._send_loop, name=thread_name, daemon=True)
        self._sender_thread.start()

    # -- admission -----------------------------------------------------------------------------
    def intake(self, requests: list[Any], input_names: Iterable[str], parse: Callable[[dict], Any],
               accept: Callable[[Any, Any, dict], None]) -> None:
        """execute()'s loop: for each request, its inputs (copies) are `parse`d — a ValueError,
        TypeError or OverflowError answers that request INVALID_ARG — and, unless the model is
        unloading, `accept(sender, parsed, arrays)` takes it, holding `_lock`."""
        for request in requests:
            sender = request.get_response_sender()
            arrays = input_arrays(request, input_names)
            try:
                parsed = parse(arrays)
            except (ValueError, TypeError, OverflowError) as exc:
                self.send_error(sender, f"bad request: {exc}", "INVALID_ARG")
                continue
            with self._lock:
                if not self.refuse_if_unloading(sender):
                    accept(sender, parsed, arrays)

    def refuse_if_unloading(self, sender: Any) -> bool:
        """(Holding `_lock`.) True, the client answered UNAVAILABLE, once finalize() has begun."""
        if self._accepting:
            return False
        self.send_error(sender, "the model is being unloaded; retry on another instance.",
                        "UNAVAILABLE")
        return True

    def drain(self, timeout_s: float, busy: Callable[[], bool]) -> None:
        """Refuse new requests, then wait up to `timeout_s` while `busy()` (requests in flight)."""
        with self._lock:
            self._accepting = False
        deadline = time.monotonic() + timeout_s
        while busy() and time.monotonic() < deadline:
            time.sleep(0.05)

    # -- responses -----------------------------------------------------------------------------
    def error(self, message: str, code: str = "INTERNAL") -> Any:
        return error_response(self.pb_utils, message, code)

    def send(self, sender: Any, response: Any, flags: int = 0, gone: Any = None) -> None:
        """Queue a response (None: flags only); `gone` (None: nothing to report) goes to
        `client_gone` if the client has left."""
        self._outbox.put((sender, response, flags, gone))

    def send_error(self, sender: Any, message: str, code: str = "INTERNAL") -> None:
        self.send(sender, self.error(message, code), self.final)

    def stop_responses(self, timeout_s: float) -> None:
        """Send what is queued, then stop the response thread."""
        self._outbox.put(None)
        self._sender_thread.join(timeout=timeout_s)

    def watch(self) -> None:
        """(Response thread, every `watch_s`.) Look for clients that went away."""

    def client_gone(self, gone: Any) -> None:
        """(Response thread.) A send found the client of `gone` (as given to `send`) gone."""

    def _send_loop(self) -> None:
        next_watch = None if self.watch_s is None else time.monotonic() + self.watch_s
        while True:
            wait = None if next_watch is None else max(0.0, next_watch - time.monotonic())
            try:
                item = self._outbox.get(timeout=wait)
            except queue.Empty:
                item = ()
            if item is None:
                return
            if item:
                sender, response, flags, gone = item
                if not try_send(sender, response, flags) and gone is not None:
                    self.client_gone(gone)
            if next_watch is not None and time.monotonic() >= next_watch:
                self.watch()
                next_watch = time.monotonic() + self.watch_s
