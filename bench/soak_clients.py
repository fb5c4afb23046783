"""Send one planned soak request and classify what came back (never raises).

gRPC goes through tritonclient's asyncio client (one bidirectional stream per request, cancelled
with the call's `cancel()`); HTTP through aiohttp (a dependency of tritonclient[http]), so a
`/generate_stream` socket can be closed mid-stream and malformed bodies sent byte for byte.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from trtforge.bench.soak_workload import ACCEPTED_MALFORMED, MALFORMED, Planned

MODEL = "ensemble"


@dataclass
class Outcome:
    """What happened to one request."""

    index: int
    kind: str
    variant: str
    outcome: str
    """ok | mismatch | cut | finished_before_cut | refused_4xx | refused_500 | refused_grpc |
    accepted_unexpectedly | error"""
    start: float
    end: float
    pieces: int = 0
    """Streamed responses (or SSE events) read."""
    status: int | None = None
    """HTTP status, when HTTP."""
    detail: str = ""

    @property
    def latency_s(self) -> float:
        return self.end - self.start


@dataclass
class Clients:
    """The connections one soak shares between its concurrent workers."""

    grpc: Any
    """tritonclient.grpc.aio.InferenceServerClient"""
    http: Any
    """aiohttp.ClientSession"""
    http_url: str
    expected: dict[tuple[str, int], str]
    timeout_s: float


def _grpc_inputs(arrays: dict[str, Any]) -> list[Any]:
    from trtforge.model_repo.client import grpc_inputs

    return grpc_inputs(arrays.pop("text_input"), arrays.pop("max_tokens"), **arrays)


def _text_of(result: Any) -> str:
    text = result.as_numpy("text_output")
    return "" if text is None else b"".join(np.asarray(text).reshape(-1)).decode("utf-8")


async def grpc_request(c: Clients, p: Planned, values: dict[str, Any], cut_after: int | None
                       ) -> tuple[str, int, str, bool]:
    """Stream one request over gRPC: (text, pieces, error, finished); cancel after `cut_after` pieces."""
    inputs = _grpc_inputs(dict(values))

    async def one():
        yield {"model_name": MODEL, "inputs": inputs, "request_id": f"soak-{p.index}-{uuid.uuid4().hex[:8]}"}

    call = c.grpc.stream_infer(one())
    text, pieces, error, finished = [], 0, "", False
    try:
        if cut_after == 0:
            await asyncio.sleep(0.005)  # the request is on its way; cut before any answer
            return "", 0, "", False
        async for result, err in call:
            if err is not None:  # an error response is final too
                error, finished = str(err), True
                break
            pieces += 1
            text.append(_text_of(result))
            if result.as_numpy("num_output_tokens") is not None:  # only the final response has it
                finished = True
                break
            if cut_after is not None and pieces >= cut_after:
                break
    finally:
        # Cancel only a call still streaming: with Triton 2.51 a cancel that follows the final
        # response leaks server-side state (the model can no longer unload), see docs/serving.md.
        if not finished:
            call.cancel()
    return "".join(text), pieces, error, finished


def _checked_values(p: Planned) -> dict[str, Any]:
    values: dict[str, Any] = {"text_input": p.prompt, "max_tokens": p.max_tokens, "temperature": 0.0}
    if p.variant == "logprobs":
        values["return_log_probs"] = True
    if p.variant == "exclude_input":
        values["exclude_input_in_output"] = True
    return values


async def _http_stream(c: Clients, body: bytes, cut_after: int | None) -> tuple[int | None, str, int, str, bool]:
    """POST /generate_stream: (status, text, events, error, finished); close the socket after `cut_after` events."""
    if cut_after == 0:
        return await _http_send_and_close(c, body)
    url = f"http://{c.http_url}/v2/models/{MODEL}/generate_stream"
    async with c.http.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            return resp.status, "", 0, (await resp.text())[:300], True
        text, events = [], 0
        async for raw in resp.content:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue
            event = json.loads(line[len("data:"):])
            if "error" in event:
                return 200, "", events, str(event["error"]), True
            events += 1
            text.append(event.get("text_output", ""))
            if cut_after is not None and events >= cut_after:
                resp.close()
                return 200, "".join(text), events, "", False
        return 200, "".join(text), events, "", True


async def _http_send_and_close(c: Clients, body: bytes) -> tuple[None, str, int, str, bool]:
    """Send a /generate_stream request on a socket of its own and close it before any answer."""
    host, port = c.http_url.rsplit(":", 1)
    _, writer = await asyncio.open_connection(host, int(port))
    head = (f"POST /v2/models/{MODEL}/generate_stream HTTP/1.1\r\nHost: {c.http_url}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    writer.write(head.encode() + body)
    await writer.drain()
    await asyncio.sleep(0.005)  # on its way to the model, not yet answered
    writer.close()
    await writer.wait_closed()
    return None, "", 0, "", False


async def _http_generate(c: Clients, body: bytes) -> tuple[int, dict[str, Any] | str]:
    url = f"http://{c.http_url}/v2/models/{MODEL}/generate"
    async with c.http.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
        raw = await resp.text()
        if resp.status != 200:
            return resp.status, raw[:300]
        return 200, json.loads(raw)


def _check(c: Clients, p: Planned, text: str, whole: bool, exclude: bool) -> tuple[str, str]:
    want = c.expected[(p.prompt, p.max_tokens)]
    if whole and not exclude:
        want = p.prompt + want  # TensorRT-LLM's default: non-streamed text includes the prompt
    if text == want:
        return "ok", ""
    return "mismatch", f"got {text[:80]!r}, expected {want[:80]!r}"


async def _checked(c: Clients, p: Planned, out: Outcome) -> None:
    values = _checked_values(p)
    if p.kind == "grpc_stream":
        values["stream"] = True
        text, out.pieces, error, finished = await grpc_request(c, p, values, None)
        if error or not finished:
            out.outcome, out.detail = "error", error or "the stream ended without a final response"
            return
        out.outcome, out.detail = _check(c, p, text, False, True)
    elif p.kind == "http_stream":
        values["stream"] = True
        out.status, text, out.pieces, error, _ = await _http_stream(c, json.dumps(values).encode(), None)
        if out.status != 200 or error:
            out.outcome, out.detail = "error", f"HTTP {out.status}: {error}"
            return
        out.outcome, out.detail = _check(c, p, text, False, True)
    else:
        out.status, answer = await _http_generate(c, json.dumps(values).encode())
        if out.status != 200:
            out.outcome, out.detail = "error", f"HTTP {out.status}: {answer}"
            return
        out.outcome, out.detail = _check(c, p, answer["text_output"], True, p.variant == "exclude_input")


async def _cut(c: Clients, p: Planned, out: Outcome) -> None:
    values = {"text_input": p.prompt, "max_tokens": p.max_tokens, "temperature": 0.0, "stream": True}
    if p.kind == "grpc_cancel":
        _, out.pieces, error, finished = await grpc_request(c, p, values, p.cut_after)
    else:
        out.status, _, out.pieces, error, finished = await _http_stream(c, json.dumps(values).encode(),
                                                                        p.cut_after)
    if error:
        out.outcome, out.detail = "error", error
    else:
        out.outcome = "finished_before_cut" if finished else "cut"


async def _malformed(c: Clients, p: Planned, out: Outcome) -> None:
    transport, payload = MALFORMED[p.variant]
    if transport == "grpc":
        values = {"text_input": p.prompt, "max_tokens": p.max_tokens, "stream": True, **payload}
        _, out.pieces, error, _ = await grpc_request(c, p, values, None)
        out.outcome, out.detail = ("refused_grpc", error) if error else ("accepted_unexpectedly", "")
        return
    if p.variant in ACCEPTED_MALFORMED:
        payload = {**payload, "text_input": p.prompt, "temperature": 0.0, "exclude_input_in_output": True}
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    out.status, answer = await _http_generate(c, body)
    if out.status == 200:
        if p.variant in ACCEPTED_MALFORMED:
            out.outcome, out.detail = _check(c, p, answer["text_output"], True, True)
        else:
            out.outcome = "accepted_unexpectedly"
        return
    out.detail = str(answer)
    out.outcome = ("refused_4xx" if 400 <= out.status < 500
                   else "refused_500" if out.status == 500 else "error")


async def send(c: Clients, p: Planned) -> Outcome:
    """Run one planned request within the per-request timeout; never raises."""
    out = Outcome(p.index, p.kind, p.variant, "error", time.perf_counter(), 0.0)
    handler = {"checked": _checked, "cut": _cut, "malformed": _malformed}[p.group]
    try:
        async with asyncio.timeout(c.timeout_s):
            await handler(c, p, out)
    except TimeoutError:
        out.outcome, out.detail = "error", f"no answer within {c.timeout_s:.0f} s"
    except Exception as exc:  # noqa: BLE001 - a failed request is a result, not the end of the soak
        out.outcome, out.detail = "error", f"{type(exc).__name__}: {exc}"[:300]
    out.end = time.perf_counter()
    return out
