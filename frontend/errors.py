"""OpenAI error objects, `{"error": {"message", "type", "param", "code"}}`, with their status.

400: a bad request (pydantic validation included: OpenAI clients expect 400, not FastAPI's 422;
a prompt over the size cap), 401: no or a wrong API key, 404: an unknown model or route, 413: a
body over the size cap, 503: Triton unreachable, the model not ready or being unloaded, 500:
anything else (a bug).

A 4xx says what was wrong with the request. A 5xx says only what kind of failure it was and the
request's id (also in the `X-Request-Id` header of every answer): what was raised, Triton's own
message and addresses go to the server log under that id, never to the client.
"""

from __future__ import annotations

import logging
import uuid
from contextvars import ContextVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from trtforge.frontend.responses import ErrorBody, ErrorResponse

log = logging.getLogger("trtforge.frontend")

REQUEST_ID: ContextVar[str] = ContextVar("trtforge_request_id", default="none")
"""The id of the request being answered (set by guard.Guard for each one, in its own task)."""

INTERNAL_ERROR = "The server had an error while processing your request"


def new_request_id() -> str:
    request_id = f"req-{uuid.uuid4().hex}"
    REQUEST_ID.set(request_id)
    return request_id


class APIError(Exception):
    """An error answered as an OpenAI error object with `status`.

    `detail` is for the server log only; for a 5xx the client's message gets the request id."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None,
                 code: str | None = None, detail: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.detail = detail
        self.headers = headers
        if status >= 500:
            request_id = REQUEST_ID.get()
            if detail:
                log.log(logging.ERROR if status == 500 else logging.WARNING,
                        "request %s: %d %s: %s", request_id, status, message, detail)
            message = f"{message} (request id {request_id})."
        self.body = ErrorBody(message=message, type=type_, param=param, code=code)

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.body).model_dump(), status_code=self.status,
                            headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param=param, code=code)


def model_not_found(model: str, served: str) -> APIError:
    return APIError(404, f"The model {model!r} does not exist; this server serves {served!r} "
                         "(GET /v1/models).", "invalid_request_error", param="model",
                    code="model_not_found")


def unauthorized() -> APIError:
    return APIError(401, "Missing or wrong API key: send the header "
                         "'Authorization: Bearer KEY' with the key this server was started with.",
                    "invalid_request_error", code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than this server takes ({limit} bytes; "
                         "`trtforge serve --max-request-bytes`).", "invalid_request_error",
                    code="request_too_large")


def unavailable(message: str, detail: str | None = None) -> APIError:
    """503; `message` must not carry internal text (addresses, Triton's own words)."""
    return APIError(503, message, "server_error", code="service_unavailable", detail=detail)


def server_error(detail: str) -> APIError:
    """500: a generic message for the client, `detail` for the log."""
    return APIError(500, INTERNAL_ERROR, "server_error", detail=detail)


def internal_error_response() -> JSONResponse:
    """The answer to an unexpected exception (already logged, with its traceback)."""
    return APIError(500, INTERNAL_ERROR, "server_error").response()


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _field_path(loc: tuple) -> list[str]:
    """Field names and list indices of a pydantic error location, without "body" and without
    the union-member tags pydantic inserts (`function-after[...]`, `list[int]`, `str`)."""
    return [str(part) for part in loc if isinstance(part, int)
            or (part.isidentifier() and part not in _TYPE_TAGS and part != "body")]


def _validation_error(exc: RequestValidationError) -> APIError:
    """The first problem pydantic found, with its field as `param`."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    param = ".".join(_field_path(first.get("loc", ()))) or None
    message = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        message = f"The body is not valid JSON ({first.get('ctx', {}).get('error', message)})."
    elif param:
        message = f"{param}: {message}"
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return bad_request(message + more, param)


def install_handlers(app: FastAPI) -> None:
    """Answer every failure, validation and routing included, with an OpenAI error object."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code >= 500:
            return server_error(f"HTTPException {exc.status_code}: {exc.detail}").response()
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), kind).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # guard.Guard catches these first; this is the net behind it.
        log.error("request %s: unexpected error", REQUEST_ID.get(), exc_info=exc)
        return internal_error_response()
