"""One Triton request per API request, over Triton's gRPC streaming API (asyncio).

Every request goes to the decoupled `ensemble` model as a stream (`stream=true`): each response
carries one engine step's text (with `return_log_probs` / `num_top_logprobs`, the
log-probabilities of the tokens it added and their alternatives; with `prompt_logprobs`, one
response also carries the prompt's), and the last response says how
the request ended: `num_input_tokens`, `num_output_tokens`, `num_cached_tokens`, `finish_reason`
and `stop_reason` / `stop_token_id`; from an engine that speculates also `total_draft_tokens`,
`total_accepted_draft_tokens`, `acceptance_rate` and `avg_decoded_tokens_per_iter`.

The call is made on tritonclient's generated gRPC stub (`tritonclient.grpc.service_pb2_grpc`) over
a `grpc.aio` channel, with requests and results in tritonclient's own types. tritonclient's aio
client (`tritonclient.grpc.aio.InferenceServerClient.stream_infer`) would do the same but refuses
to set `triton_enable_empty_final_response`: without that flag a decoupled model's last response
is dropped when it carries no output, and a stream could never learn that it had ended.

Cancelling the iteration (client gone) cancels the gRPC call; Triton then marks the request
cancelled, and the model aborts it and frees its KV blocks.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import AsyncIterator

import grpc
import numpy as np
from tritonclient.grpc import InferResult, service_pb2, service_pb2_grpc
from tritonclient.utils import np_to_triton_dtype, serialize_byte_tensor

from trtforge.frontend.errors import APIError, bad_request, server_error, unavailable
from trtforge.model_repo.interface import ENSEMBLE
from trtforge.model_repo.python_models.base import top_logprobs_of

_MAX_MESSAGE = (1 << 31) - 1  # as tritonclient: prompts and answers are not size-limited here
_READY_TIMEOUT_S = 3.0
# Words in the ensemble's (and Triton's) error messages that mean "not servable right now".
# ("server busy": the engine's waiting queue is full, max_queue_size / max_queued_tokens.)
_UNAVAILABLE_MARKERS = ("server busy", "being unloaded", "unknown model", "not ready",
                        "is not found", "unavailable", "was unloaded")


@dataclass
class Piece:
    """What one Triton response said."""

    text: str
    """New text (a delta)."""
    logprobs: list[float]
    """Log-probability of each token this response added, in order."""
    final: bool
    """The last response of the request."""
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Per token of this response (when asked): its most likely (token id, logprob) pairs."""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    """The stop string, or the stop token id, that ended the request."""
    num_cached_tokens: int | None = None
    prompt_logprobs: list[PromptEntry] | None = None
    """On the response carrying them (prompt_logprobs asked): per prompt token after the first."""
    total_draft_tokens: int | None = None
    """The last response of a speculating engine: drafts verified for the request (TensorRT-LLM's)."""
    total_accepted_draft_tokens: int | None = None
    """Of those, accepted."""
    acceptance_rate: float | None = None
    avg_decoded_tokens_per_iter: float | None = None
    """Tokens generated per engine step of the request (1 + the accepted drafts per step)."""


@dataclass
class PromptEntry:
    """One prompt token's log-probability given the tokens before it (the ensemble's
    prompt_log_probs / prompt_logprob_ranks / prompt_top_logprobs_ids / prompt_top_logprobs row)."""

    logprob: float
    rank: int
    top: list[tuple[int, float]]
    """Its position's most likely (token id, logprob) pairs, most likely first."""


def prompt_entries(result: InferResult) -> list[PromptEntry] | None:
    """The prompt logprobs of a response, None if it has none."""
    logprobs, ranks = result.as_numpy("prompt_log_probs"), result.as_numpy("prompt_logprob_ranks")
    if logprobs is None or ranks is None:
        return None
    ids, values = result.as_numpy("prompt_top_logprobs_ids"), result.as_numpy("prompt_top_logprobs")
    top = top_logprobs_of({"top_logprobs_ids": ids, "top_logprobs": values}) if ids is not None \
        and values is not None else None
    logprobs, ranks = np.asarray(logprobs).reshape(-1).tolist(), np.asarray(ranks).reshape(-1).tolist()
    return [PromptEntry(float(lp), int(rank), top[i] if top else [])
            for i, (lp, rank) in enumerate(zip(logprobs, ranks))]


def error_for_message(message: str) -> APIError:
    """The API error for an error response of the model or of Triton. A refusal (4xx) passes the
    model's message on; otherwise the client learns only the kind of failure (503: the marker
    found), and the message goes to the log."""
    lowered = message.lower()
    if lowered.startswith("bad request"):  # the ensemble's prefix for a request it refuses
        return bad_request(message)
    marker = next((m for m in _UNAVAILABLE_MARKERS if m in lowered), None)
    if marker is not None:
        return unavailable(f"The model cannot take this request now ({marker}); retry later",
                           detail=f"Triton answered: {message}")
    return server_error(f"Triton answered with an error: {message}")


def error_for_rpc(exc: grpc.aio.AioRpcError, url: str) -> APIError:
    """The API error for a failed gRPC call."""
    code = exc.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.DEADLINE_EXCEEDED):
        return unavailable(f"Triton is unavailable or overloaded ({code.name}); retry later",
                           detail=f"gRPC to {url}: {code.name}: {exc.details()}")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return bad_request(f"Triton refused the request: {exc.details()}")
    return server_error(f"gRPC to {url} failed ({code.name}: {exc.details()})")


def infer_request(model: str, arrays: dict[str, np.ndarray],
                  request_id: str) -> service_pb2.ModelInferRequest:
    """A streaming ModelInferRequest asking for an (empty, if need be) final response."""
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    for name, array in arrays.items():
        tensor = request.inputs.add()
        tensor.name = name
        tensor.datatype = np_to_triton_dtype(array.dtype)
        tensor.shape.extend(array.shape)
        if tensor.datatype == "BYTES":
            request.raw_input_contents.append(serialize_byte_tensor(array).item())
        else:
            request.raw_input_contents.append(np.ascontiguousarray(array).tobytes())
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    return request


def _optional_int(result: InferResult, name: str) -> int | None:
    array = result.as_numpy(name)
    return None if array is None else int(np.asarray(array).reshape(-1)[0])


def _optional_float(result: InferResult, name: str) -> float | None:
    array = result.as_numpy(name)
    return None if array is None else float(np.asarray(array).reshape(-1)[0])


def _optional_text(result: InferResult, name: str) -> str | None:
    array = result.as_numpy(name)
    if array is None or not np.asarray(array).size:
        return None
    value = np.asarray(array).reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def piece_of(response: service_pb2.ModelInferResponse) -> Piece:
    result = InferResult(response)
    text = result.as_numpy("text_output")
    logprobs = result.as_numpy("output_log_probs")
    stop_token = _optional_int(result, "stop_token_id")
    stop_text = _optional_text(result, "stop_reason")
    top = {name: result.as_numpy(name) for name in ("top_logprobs_ids", "top_logprobs")}
    return Piece(
        text=b"".join(np.asarray(text).reshape(-1)).decode("utf-8") if text is not None else "",
        logprobs=[] if logprobs is None else [float(x) for x in np.asarray(logprobs).reshape(-1)],
        final=response.parameters["triton_final_response"].bool_param,
        num_input_tokens=_optional_int(result, "num_input_tokens"),
        num_output_tokens=_optional_int(result, "num_output_tokens"),
        top_logprobs=top_logprobs_of({k: v for k, v in top.items() if v is not None}),
        finish_reason=_optional_text(result, "finish_reason"),
        stop_reason=stop_text if stop_text is not None else stop_token,
        num_cached_tokens=_optional_int(result, "num_cached_tokens"),
        prompt_logprobs=prompt_entries(result),
        total_draft_tokens=_optional_int(result, "total_draft_tokens"),
        total_accepted_draft_tokens=_optional_int(result, "total_accepted_draft_tokens"),
        acceptance_rate=_optional_float(result, "acceptance_rate"),
        avg_decoded_tokens_per_iter=_optional_float(result, "avg_decoded_tokens_per_iter"),
    )


class TritonBridge:
    """A gRPC channel to one tritonserver; create and close it inside the serving event loop."""

    def __init__(self, url: str, model: str = ENSEMBLE) -> None:
        self.url = url
        self.model = model
        self._channel = grpc.aio.insecure_channel(url, options=[
            ("grpc.max_send_message_length", _MAX_MESSAGE),
            ("grpc.max_receive_message_length", _MAX_MESSAGE)])
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def ready(self) -> bool:
        """Triton is up and the model is ready to take requests."""
        try:
            server = await self._stub.ServerReady(service_pb2.ServerReadyRequest(),
                                                  timeout=_READY_TIMEOUT_S)
            model = await self._stub.ModelReady(service_pb2.ModelReadyRequest(name=self.model),
                                                timeout=_READY_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return False
        return bool(server.ready and model.ready)

    async def generate(self, arrays: dict[str, np.ndarray]) -> AsyncIterator[Piece]:
        """Yield the request's responses until the final one; raise APIError on an error.

        Closing or cancelling the iteration early cancels the request in Triton.
        """
        request = infer_request(self.model, arrays, f"openai-{uuid.uuid4().hex}")

        async def one_request() -> AsyncIterator[service_pb2.ModelInferRequest]:
            yield request

        call = self._stub.ModelStreamInfer(one_request())
        finished = False
        try:
            async for response in call:
                if response.error_message:
                    finished = True  # an error response is the request's last
                    raise error_for_message(response.error_message)
                piece = piece_of(response.infer_response)
                finished = piece.final
                yield piece
                if finished:
                    return
            raise unavailable("Triton closed the stream before the request finished (is it "
                              "shutting down?); retry later", detail=f"gRPC stream to {self.url}")
        except grpc.aio.AioRpcError as exc:
            raise error_for_rpc(exc, self.url) from None
        finally:
            # A finished request's stream closes by itself (the request side is already
            # closed); cancelling it then would race Triton's own completion of the request.
            if not finished:
                call.cancel()  # Triton marks the request cancelled; the model frees its blocks
