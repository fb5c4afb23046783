"""Running a Triton request for an HTTP client that may leave: SSE framing and disconnects.

A client that disconnects cancels its Triton request (the model then frees its KV blocks):
streamed answers through `SSEResponse` (Starlette cancels the body iterator when the client goes,
and we close it whatever happened), non-streamed ones through `unless_disconnected`.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Awaitable, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from trtforge.frontend.errors import APIError
from trtforge.frontend.responses import ErrorResponse

T = TypeVar("T")

DONE = "data: [DONE]\n\n"


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


def sse(model: BaseModel, exclude: set[str] | None = None) -> str:
    """One server-sent event carrying a response model as JSON."""
    return f"data: {model.model_dump_json(exclude=exclude)}\n\n"


def sse_error(error: APIError) -> str:
    """An error after the stream started (its status is already sent): OpenAI's SDK raises it."""
    return f"data: {ErrorResponse(error=error.body).model_dump_json()}\n\n"


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect (uvicorn also reports
    # one once the response is complete, which is never seen here: the waiter is cancelled).
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and so its Triton request) if the client disconnects."""
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, APIError):
        await task
    raise ClientGone()


class SSEResponse(StreamingResponse):
    """text/event-stream whose body iterator is always closed, so its Triton request is
    cancelled even when sending (not the Triton call) was interrupted by the disconnect."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str]) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache",
                                          "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
