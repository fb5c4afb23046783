"""The FastAPI app of the OpenAI-compatible endpoint, and a uvicorn thread to run it.

`create_app(served, triton_grpc_url)` is the whole API; `OpenAIServer` runs it beside
tritonserver in `trtforge serve --openai-port` (a thread, so one Ctrl-C stops both).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse

from trtforge.frontend.endpoints import create_chat_completion, create_completion
from trtforge.frontend.errors import install_handlers, model_not_found, unavailable
from trtforge.frontend.responses import ChatCompletion, Completion, ErrorResponse, ModelCard, ModelList
from trtforge.frontend.served_model import ServedModel
from trtforge.frontend.triton_bridge import TritonBridge

_ERRORS = {status: {"model": ErrorResponse, "description": why} for status, why in (
    (400, "Invalid request (validation included)"), (404, "Unknown model"),
    (503, "Triton unavailable, overloaded or the model not ready"))}


def create_app(served: ServedModel, triton_grpc_url: str) -> FastAPI:
    """The API for `served`, forwarding to the tritonserver at `triton_grpc_url` (host:port)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The gRPC channel belongs to the serving event loop: made here, closed here.
        app.state.bridge = TritonBridge(triton_grpc_url, served.triton_model)
        try:
            yield
        finally:
            await app.state.bridge.close()

    app = FastAPI(title="trtforge OpenAI-compatible API", version="1", lifespan=lifespan,
                  description=f"Serves {served.name!r} through Triton at {triton_grpc_url}.")
    app.state.served = served
    install_handlers(app)

    @app.get("/health", responses={503: _ERRORS[503]})
    async def health(request: Request) -> JSONResponse:
        """200 when Triton is up and its model ready; 503 otherwise."""
        if not await request.app.state.bridge.ready():
            raise unavailable(f"Triton at {triton_grpc_url} is not ready (or its model "
                              f"{served.triton_model!r} is not loaded).")
        return JSONResponse({"status": "ok"})

    def card() -> ModelCard:
        return ModelCard(id=served.name, created=served.created)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        return ModelList(data=[card()])

    @app.get("/v1/models/{model}", response_model=ModelCard, responses={404: _ERRORS[404]})
    async def get_model(model: str) -> ModelCard:
        if model != served.name:
            raise model_not_found(model, served.name)
        return card()

    app.post("/v1/completions", response_model=Completion, responses=_ERRORS,
             summary="Create a completion (SSE with stream=true)")(create_completion)
    app.post("/v1/chat/completions", response_model=ChatCompletion, responses=_ERRORS,
             summary="Create a chat completion (SSE with stream=true)")(create_chat_completion)
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
                                access_log=False, lifespan="on")
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

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop accepting, cancel what is in flight (closing its Triton requests), join."""
        self._server.should_exit = True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(timeout_s)
