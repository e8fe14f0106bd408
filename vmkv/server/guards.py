"""Checks every request passes before a handler runs: the API key and the body size."""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Sequence

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vmkv.server.errors import error_response

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
            await error_response(413, self._message(declared), path=scope["path"])(scope, receive, send)
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


class RequestIdHeaders:
    """Answers every request with an X-Request-Id header: the request's own, else a new one
    (vLLM's --enable-request-id-headers), so a proxy or client can match logs to answers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = Headers(scope=scope).get("x-request-id") or uuid.uuid4().hex

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {
                    **message,
                    "headers": [*message.get("headers", []), (b"x-request-id", request_id.encode())],
                }
            await send(message)

        await self.app(scope, receive, send_with_id)


PROBE_PATHS = ("/health", "/version")  # what a load balancer or orchestrator asks without a key


class APIKeyGuard:
    """Answers 401 unless the request carries `Authorization: Bearer <key>` (or, as Anthropic's
    clients send it, `x-api-key: <key>`) for one of `keys`.

    It runs before anything else reads the request, so an unauthenticated caller learns
    nothing (not even whether its JSON parses). Every route wants a key, the API docs and the
    metrics included (their counters would tell a stranger whether a prompt is cached), except
    the probes, and /metrics when `open_metrics`. Each key is compared in constant time, and
    all of them always, so the time taken tells nothing about which one came close.
    """

    def __init__(self, app: ASGIApp, keys: Sequence[str], open_metrics: bool = False) -> None:
        if not keys or any(not isinstance(key, str) or not key for key in keys):
            raise ValueError("API keys must be non-empty strings")
        self.app = app
        self.keys = [key.encode() for key in keys]
        self.open_paths = PROBE_PATHS + (("/metrics",) if open_metrics else ())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        bearer = headers.get("authorization", "").encode()
        x_api_key = headers.get("x-api-key", "").encode()
        matches = [secrets.compare_digest(bearer, b"Bearer " + key) for key in self.keys] + [
            secrets.compare_digest(x_api_key, key) for key in self.keys
        ]
        if not any(matches):
            response = error_response(
                401, "missing or invalid API key: send 'Authorization: Bearer <key>'", path=scope["path"]
            )
            response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
