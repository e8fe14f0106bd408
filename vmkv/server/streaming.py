"""Server-sent events as OpenAI streams them, and the async plumbing that keeps requests abortable.

One `data: {json}` event per chunk, then `data: [DONE]`. A stream's generator is always
closed when its response ends, however it ends, so the engine requests behind it are
aborted at once rather than whenever the garbage collector gets to them; a plain response's
work is cancelled when its client disconnects (`until_disconnected`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Awaitable
from typing import TypeVar

from pydantic import BaseModel
from pydantic_core import to_jsonable_python
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

SSE_MEDIA_TYPE = "text/event-stream"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE_EVENT = "data: [DONE]\n\n"


# Characters JSON may leave raw that Python's str.splitlines (and so httpx's aiter_lines) ends
# a line at: generated text holding one cut a client's `data:` line in two. Escaped, every JSON
# parser reads the same string.
_LINE_BREAKS = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def sse_event(payload: BaseModel | dict) -> str:
    """One event on one `data:` line: JSON escapes newlines, and _LINE_BREAKS the rest."""
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {one_line(body)}\n\n"


def typed_event(kind: str, fields: dict[str, object]) -> str:
    """One event of an API that names its events (Responses, Anthropic's Messages): the type on
    an `event:` line, and the fields, led by the same type, as JSON."""
    body = json.dumps(to_jsonable_python({"type": kind, **fields}, by_alias=True))
    return f"event: {kind}\ndata: {body}\n\n"


def one_line(body: str) -> str:
    """A JSON text with the line breaks JSON leaves raw escaped (json.dumps escapes every
    non-ASCII character by default; pydantic's JSON writes them raw)."""
    return body if body.isascii() else body.translate(_LINE_BREAKS)


class EventStreamResponse(StreamingResponse):
    """An SSE response that closes its generator when the response ends, even on a disconnect.

    On a disconnect Starlette cancels the sending task; if the generator was parked at a
    `yield` at that moment the cancellation never reaches it, so it is closed here.
    """

    body_iterator: AsyncGenerator[str, None]

    def __init__(self, events: AsyncGenerator[str, None]) -> None:
        super().__init__(events, media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def merge(streams: list[AsyncGenerator[T, None]]) -> AsyncGenerator[tuple[int, T], None]:
    """(stream number, item) from several async generators in arrival order.

    Closing the merge closes every stream, so abandoning it aborts whatever they drive.
    """
    if len(streams) == 1:  # the common case: no task per item
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()
        return
    pending = {asyncio.ensure_future(anext(stream)): i for i, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[i]))] = i
                yield i, item
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


class ClientDisconnected(Exception):
    """The client went away before its answer was ready."""


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work` unless the client disconnects first; then cancel it and raise ClientDisconnected."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        if not work_task.done():
            work_task.cancel()
            await asyncio.gather(work_task, return_exceptions=True)
    if work_task.cancelled():
        raise ClientDisconnected
    return work_task.result()


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body is read, so receive() has nothing else to say)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
