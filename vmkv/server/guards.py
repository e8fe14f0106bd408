"""Checks every request passes before a handler runs: body size and the API key."""

from __future__ import annotations

import secrets
from collections.abc import Callable

from fastapi import Request
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vmkv.server.errors import APIError, error_response

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


class BodySizeLimit:
    """Answers 413 to a body over `max_bytes`, whether it declares its length or streams in chunks.

    A declared Content-Length over the limit is refused before any byte is read. A chunked
    body is counted as it arrives and reading stops at the first byte past the limit, so an
    oversized body never sits in memory whole.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await error_response(413, self._message(declared))(scope, receive, send)
            return

        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # The handler reading the body gets this; FastAPI passes it on to the error handler.
                    raise HTTPException(413, self._message(f"more than {self.max_bytes}"))
            return message

        await self.app(scope, counting_receive, send)

    def _message(self, size: str) -> str:
        return f"request body of {size} bytes is over the limit of {self.max_bytes} bytes"


def api_key_checker(api_key: str) -> Callable[[Request], None]:
    """A FastAPI dependency that accepts only `Authorization: Bearer <api_key>`."""
    expected = f"Bearer {api_key}".encode()

    def check_api_key(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if not secrets.compare_digest(given, expected):
            raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'")

    return check_api_key
