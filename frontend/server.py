"""The FastAPI app of the OpenAI-compatible endpoint, and a uvicorn thread to run it.

`create_app(served, triton_grpc_url, limits)` is the whole API, behind guard.Guard (request ids,
API key, body cap); `OpenAIServer` runs it beside tritonserver in `trtforge serve --openai-port`
(a thread, so one Ctrl-C stops both).
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse

from trtforge.frontend.chat import create_chat_completion
from trtforge.frontend.endpoints import create_completion, detokenize, tokenize
from trtforge.frontend.errors import install_handlers, model_not_found, unavailable
from trtforge.frontend.guard import Guard, Limits
from trtforge.frontend.responses import (
    ChatCompletion,
    Completion,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
)
from trtforge.frontend.served_model import ServedModel
from trtforge.frontend.service import check_limits
from trtforge.frontend.triton_bridge import TritonBridge

_ERRORS = {status: {"model": ErrorResponse, "description": why} for status, why in (
    (400, "Invalid request (validation included), or a prompt over the size cap"),
    (401, "No or a wrong API key (when the server has one)"), (404, "Unknown model"),
    (413, "Request body over the size cap"),
    (503, "Triton unavailable, overloaded or the model not ready"))}
_GET_ERRORS = {status: _ERRORS[status] for status in (401, 404)}


def create_app(served: ServedModel, triton_grpc_url: str, limits: Limits | None = None) -> FastAPI:
    """The API for `served`, forwarding to the tritonserver at `triton_grpc_url` (host:port);
    `limits` (guard.Limits: API key, size caps) default to no key and caps sized for the engine."""
    limits = (limits or Limits()).resolved(served.max_seq_len)
    check_limits(served, limits)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The gRPC channel belongs to the serving event loop: made here, closed here.
        app.state.bridge = TritonBridge(triton_grpc_url, served.triton_model)
        app.state.tokenizer_pool = ThreadPoolExecutor(limits.tokenizer_threads,
                                                      thread_name_prefix="trtforge-tokenizer")
        try:
            yield
        finally:
            app.state.tokenizer_pool.shutdown(wait=False, cancel_futures=True)
            await app.state.bridge.close()

    app = FastAPI(title="trtforge OpenAI-compatible API", version="1", lifespan=lifespan,
                  description=f"Serves {served.name!r} through Triton Inference Server.")
    app.state.served = served
    app.state.limits = limits
    install_handlers(app)
    app.add_middleware(Guard, limits=limits)

    @app.get("/health", responses={503: _ERRORS[503]})
    async def health(request: Request) -> JSONResponse:
        """200 when Triton is up and its model ready; 503 otherwise. Needs no API key."""
        if not await request.app.state.bridge.ready():
            raise unavailable("Triton is not ready, or its model is not loaded")
        return JSONResponse({"status": "ok"})

    def card() -> ModelCard:
        return ModelCard(id=served.name, created=served.created)

    @app.get("/v1/models", response_model=ModelList, responses={401: _ERRORS[401]})
    async def list_models() -> ModelList:
        return ModelList(data=[card()])

    @app.get("/v1/models/{model}", response_model=ModelCard, responses=_GET_ERRORS)
    async def get_model(model: str) -> ModelCard:
        if model != served.name:
            raise model_not_found(model, served.name)
        return card()

    app.post("/v1/completions", response_model=Completion, responses=_ERRORS,
             summary="Create a completion (SSE with stream=true)")(create_completion)
    app.post("/v1/chat/completions", response_model=ChatCompletion, responses=_ERRORS,
             summary="Create a chat completion (SSE with stream=true)")(create_chat_completion)
    tokenizer_errors = {status: _ERRORS[status] for status in (400, 401, 404, 413)}
    app.post("/tokenize", response_model=TokenizeResponse, responses=tokenizer_errors,
             summary="Token ids of a prompt or of chat messages (vLLM's)")(tokenize)
    app.post("/detokenize", response_model=DetokenizeResponse, responses=tokenizer_errors,
             summary="Text of token ids (vLLM's)")(detokenize)
    app.openapi = lambda: _openapi_without_422(app)  # type: ignore[method-assign]
    return app


def _openapi_without_422(app: FastAPI) -> dict:
    """The generated schema, less the 422 FastAPI documents for every body: validation errors
    are answered 400 here (errors.py), and the schema must say what the server does."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description,
                             routes=app.routes)
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        for unused in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(unused, None)
        app.openapi_schema = schema
    return app.openapi_schema


class OpenAIServer:
    """uvicorn serving an app on a background thread; `start()` returns once it listens."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        self.host, self.port = host, port
        config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                                access_log=False, lifespan="on", server_header=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="trtforge-openai",
                                        daemon=True)

    def start(self, timeout_s: float = 30.0) -> "OpenAIServer":
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the OpenAI-compatible server did not start on "
                                   f"{self.host}:{self.port} (port in use?); see the log above.")
            time.sleep(0.05)
        return self

    def addresses(self) -> list[tuple[str, int]]:
        """(host, port) of each socket it listens on, as bound (after `start()`)."""
        return [sock.getsockname()[:2] for server in self._server.servers
                for sock in server.sockets]

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop accepting, cancel what is in flight (closing its Triton requests), join."""
        self._server.should_exit = True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(timeout_s)
