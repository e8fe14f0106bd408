"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` for every failure,
but under /v1/messages, whose clients read Anthropic's `{"type": "error", "error": {"type",
"message"}}` (the field at fault leads the message there).

SDK clients map the HTTP status to an exception class and read the message; a validation
failure names the offending request field in `param`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from vmkv.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

ANTHROPIC_PATH = "/v1/messages"  # and the routes under it
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


class APIError(Exception):
    """Raised by a handler to answer with an error; nothing about the engine's state changed."""

    def __init__(
        self, status: int, message: str, param: str | None = None, retry_after: int | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after = retry_after  # seconds, sent as Retry-After


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


@contextmanager
def params_renamed(names: dict[str, str]) -> Iterator[None]:
    """For an endpoint served as another request (Responses and Messages as chat, functions as
    tools): an APIError raised inside names the field of this request that the other one's
    came from (`names`: the other request's field -> this request's)."""
    try:
        yield
    except APIError as error:
        error.param = names.get(error.param, error.param)
        raise


def error_body(status: int, message: str, param: str | None = None, path: str = "") -> dict:
    """The error's body in the format the route's clients read."""
    if path.startswith(ANTHROPIC_PATH):
        error_type = ANTHROPIC_ERROR_TYPES.get(
            status, "invalid_request_error" if status < 500 else "api_error"
        )
        return {
            "type": "error",
            "error": {"type": error_type, "message": f"{param}: {message}" if param else message},
        }
    error_type = ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    info = ErrorInfo(message=message, type=error_type, param=param, code=status)
    return ErrorResponse(error=info).model_dump()


def error_response(status: int, message: str, param: str | None = None, path: str = "") -> JSONResponse:
    return JSONResponse(error_body(status, message, param, path), status_code=status)


def _location(loc: tuple) -> str:
    return ".".join(str(part) for part in loc[1:] if part != "body") or "body"


def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    fields = [e["loc"][1] for e in errors if len(e["loc"]) > 1 and isinstance(e["loc"][1], str)]
    problems = "; ".join(f"{_location(tuple(e['loc']))}: {e['msg']}" for e in errors[:5])
    param = fields[0] if fields else None
    return error_response(400, f"invalid request: {problems}", param, request.url.path)


def _api_error(request: Request, exc: APIError) -> JSONResponse:
    response = error_response(exc.status, exc.message, exc.param, request.url.path)
    if exc.retry_after is not None:
        response.headers["Retry-After"] = str(exc.retry_after)
    return response


def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail), None, request.url.path)


def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    logger.error("unexpected error answering %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, f"internal error: {type(exc).__name__}: {exc}", None, request.url.path)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
