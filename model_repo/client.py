"""Talk to the `ensemble` model: gRPC streaming (tritonclient) and HTTP /generate(_stream).

The same request options work on every path; they are the optional inputs of the ensemble
(`temperature=0.7`, `stop_words=["\\n\\n"]`, `return_log_probs=True`, …), given as keyword
arguments and typed from the interface table so a wrong dtype cannot reach the server.
"""

from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request
import uuid
from typing import Any, Iterator

import numpy as np

from trtforge.model_repo.interface import ENSEMBLE, INPUTS, PHASE_INPUTS

_NUMPY = {"TYPE_STRING": np.object_, "TYPE_INT32": np.int32, "TYPE_FP32": np.float32,
          "TYPE_UINT64": np.uint64, "TYPE_BOOL": np.bool_}
_WIRE = {"TYPE_STRING": "BYTES", "TYPE_INT32": "INT32", "TYPE_FP32": "FP32",
         "TYPE_UINT64": "UINT64", "TYPE_BOOL": "BOOL"}
_SPECS = {s.name: s for s in INPUTS}
_ALL_SPECS = {s.name: s for s in INPUTS + PHASE_INPUTS}


def request_arrays(prompt: str, max_tokens: int, **options: Any) -> dict[str, np.ndarray]:
    """{input name: array with the batch dimension} for one request; None options are dropped."""
    values = {"text_input": prompt, "max_tokens": max_tokens,
              **{k: v for k, v in options.items() if v is not None}}
    arrays = {}
    for name, value in values.items():
        spec = _SPECS.get(name)
        if spec is None:
            raise ValueError(f"unknown ensemble input {name!r}; known: {', '.join(_SPECS)}")
        items = value if isinstance(value, (list, tuple)) else [value]
        if spec.dtype == "TYPE_STRING":
            items = [str(v).encode("utf-8") for v in items]
        arrays[name] = np.array([items], dtype=_NUMPY[spec.dtype])  # [1, n]: batch of one
    return arrays


def grpc_inputs(prompt: str, max_tokens: int, **options: Any) -> list[Any]:
    """tritonclient gRPC InferInputs of one request (sync and asyncio clients take the same)."""
    return infer_inputs(request_arrays(prompt, max_tokens, **options))


def infer_inputs(arrays: dict[str, np.ndarray]) -> list[Any]:
    """tritonclient gRPC InferInputs of input arrays (with their batch dimension), typed from the
    interface table (the ensemble's inputs and the phase models' request_type and
    context_phase_params)."""
    import tritonclient.grpc as grpcclient  # optional dependency

    inputs = []
    for name, arr in arrays.items():
        dtype = _ALL_SPECS[name].dtype
        tensor = grpcclient.InferInput(name, list(arr.shape), _WIRE[dtype])
        tensor.set_data_from_numpy(np.asarray(arr, dtype=_NUMPY[dtype]))
        inputs.append(tensor)
    return inputs


def stream_grpc(url: str, prompt: str, max_tokens: int, model: str = ENSEMBLE,
                wait_s: float = 300.0, **options: Any) -> Iterator[str]:
    """Yield `text_output` pieces as the server sends them (gRPC bidirectional stream).

    `wait_s` bounds the wait for each response here; the `timeout_s` option is the request's
    deadline on the server.

    Closing the generator early (e.g. `break`) cancels the request on the server, which aborts
    it and frees its KV blocks. Raises RuntimeError with the server's message on an error.
    """
    import tritonclient.grpc as grpcclient  # optional dependency

    options.setdefault("stream", True)
    inputs = grpc_inputs(prompt, max_tokens, **options)
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    finished = False
    try:
        client.async_stream_infer(model, inputs, request_id=uuid.uuid4().hex,
                                  enable_empty_final_response=True)
        while not finished:
            try:
                result, error = responses.get(timeout=wait_s)
            except queue.Empty:
                raise TimeoutError(f"no response from {url} within {wait_s:.0f} s") from None
            if error is not None:
                finished = True
                raise RuntimeError(f"server error: {error}")
            params = result.get_response().parameters
            finished = params["triton_final_response"].bool_param
            text = result.as_numpy("text_output")
            if text is not None:
                yield b"".join(np.asarray(text).reshape(-1)).decode("utf-8")
    finally:
        client.stop_stream(cancel_requests=not finished)
        client.close()


def _http_base(url: str) -> str:
    return url if url.startswith(("http://", "https://")) else f"http://{url}"


def _post(url: str, body: dict, wait_s: float) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        return urllib.request.urlopen(request, timeout=wait_s)  # user's URL
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        raise RuntimeError(f"server answered HTTP {exc.code}: {detail}") from None


def _http_body(prompt: str, max_tokens: int, options: dict[str, Any]) -> dict:
    return {"text_input": prompt, "max_tokens": max_tokens,
            **{k: v for k, v in options.items() if v is not None}}


def generate_http(url: str, prompt: str, max_tokens: int, model: str = ENSEMBLE,
                  wait_s: float = 300.0, **options: Any) -> dict:
    """POST /v2/models/<model>/generate; returns the JSON answer (`text_output`, …)."""
    with _post(f"{_http_base(url)}/v2/models/{model}/generate",
               _http_body(prompt, max_tokens, options), wait_s) as resp:
        return json.loads(resp.read())


def stream_http(url: str, prompt: str, max_tokens: int, model: str = ENSEMBLE,
                wait_s: float = 300.0, **options: Any) -> Iterator[dict]:
    """POST /v2/models/<model>/generate_stream; yields each server-sent event's JSON."""
    options.setdefault("stream", True)
    with _post(f"{_http_base(url)}/v2/models/{model}/generate_stream",
               _http_body(prompt, max_tokens, options), wait_s) as resp:
        for raw in resp:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue
            event = json.loads(line[len("data:"):])
            if "error" in event:
                raise RuntimeError(f"server error: {event['error']}")
            yield event
