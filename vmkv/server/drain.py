"""Graceful shutdown: on SIGTERM or Ctrl-C, stop taking work, let what runs finish, then stop.

A server killed mid-stream leaves its clients with a truncated body and no reason. Here the
first signal starts a drain: generation requests and /health answer 503 with Retry-After
(so a load balancer sends traffic elsewhere), requests in flight run on for up to the grace
period, then the engine stops, which ends every stream still open with an error event and
`[DONE]`, and the process exits with status 0. A second signal stops at once, as uvicorn does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from vmkv.server.errors import error_response

logger = logging.getLogger(__name__)
DEFAULT_GRACE_SECONDS = 30.0
RETRY_AFTER_SECONDS = 5
FLUSH_SECONDS = 2.0  # for the streams the engine's stop just ended to send their last events
DRAINED_PATHS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/embeddings",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
    "/health",
)


class Drain:
    """ASGI middleware: counts generation requests in flight, refuses new work once draining.
    `background` counts the work that runs on after its request has returned (background
    responses), which a drain lets finish too."""

    def __init__(self, app: ASGIApp, background: Callable[[], int] = lambda: 0) -> None:
        self.app = app
        self.background = background
        self.draining = False
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in DRAINED_PATHS:
            await self.app(scope, receive, send)
            return
        if self.draining:
            response = error_response(
                503, "the server is shutting down; retry on another instance", path=scope["path"]
            )
            response.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
            await response(scope, receive, send)
            return
        counted = scope["path"] != "/health"
        self.in_flight += counted
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= counted

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no generation request is in flight; False if `timeout` passed first."""
        deadline = time.monotonic() + timeout
        while self.busy and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.busy

    @property
    def busy(self) -> int:
        return self.in_flight + self.background()


class DrainingServer(uvicorn.Server):
    """uvicorn, with the first stop signal starting a drain of `drain` instead of a hard stop."""

    def __init__(
        self, config: uvicorn.Config, drain: Drain, stop_engine: Callable[[], None], grace_seconds: float
    ) -> None:
        super().__init__(config)
        self.drain = drain
        self.stop_engine = stop_engine
        self.grace_seconds = grace_seconds

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain.draining:
            super().handle_exit(sig, frame)  # a second signal: stop now
            return
        self.drain.draining = True
        with contextlib.suppress(RuntimeError):  # no loop runs yet: nothing to drain
            asyncio.get_running_loop().create_task(self._drain_then_exit())
            return
        self.should_exit = True

    async def _drain_then_exit(self) -> None:
        logger.info("draining: %d requests in flight, up to %.0f s", self.drain.busy, self.grace_seconds)
        if not await self.drain.wait_idle(self.grace_seconds):
            logger.warning("grace period over: ending %d requests with an error", self.drain.busy)
        await asyncio.to_thread(self.stop_engine)
        await self.drain.wait_idle(FLUSH_SECONDS)
        self.should_exit = True
