"""OpenAI error objects, `{"error": {"message", "type", "param", "code"}}`, with their status.

400: a bad request (pydantic validation included: OpenAI clients expect 400, not FastAPI's 422),
404: an unknown model or route, 503: Triton unreachable, the model not ready or being unloaded,
500: anything else (a bug: the message says what was raised).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from trtforge.frontend.responses import ErrorBody, ErrorResponse


class APIError(Exception):
    """An error answered as an OpenAI error object with `status`."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorBody(message=message, type=type_, param=param, code=code)

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.body).model_dump(), status_code=self.status)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param=param)


def model_not_found(model: str, served: str) -> APIError:
    return APIError(404, f"The model {model!r} does not exist; this server serves {served!r} "
                         "(GET /v1/models).", "invalid_request_error", param="model",
                    code="model_not_found")


def unavailable(message: str) -> APIError:
    return APIError(503, message, "server_error", code="service_unavailable")


def server_error(message: str) -> APIError:
    return APIError(500, message, "server_error")


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
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), kind).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return server_error(f"internal error: {type(exc).__name__}: {exc}").response()
