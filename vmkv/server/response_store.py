"""Responses kept after they are answered: fetched again by id, continued with
`previous_response_id`, and, for background responses, polled or followed while they run.

The store is the API process's memory, bounded by a byte budget: past it, the least recently
used finished response goes first (a running one is never dropped, or its run would be lost).
A response's size is its JSON, its conversation's and its stream's, a lower bound of what the
objects hold. Nothing survives a restart; OpenAI keeps responses for 30 days, a server keeps them
while they fit.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from vmkv.server.errors import APIError
from vmkv.server.protocol import ChatMessage
from vmkv.server.responses_protocol import ResponseObject

DEFAULT_STORE_MIB = 64.0


@dataclass
class StoredResponse:
    response: ResponseObject  # as it stands: queued or in progress until its run ends
    conversation: list[ChatMessage] = field(default_factory=list)  # what a continuation starts from
    input_items: list[dict[str, Any]] = field(default_factory=list)  # its request's input, listed back
    events: list[str] | None = None  # a background stream's events so far, by sequence number
    run: asyncio.Task | None = None  # a background response's run
    done: bool = True  # False while that run goes on
    grown: asyncio.Event = field(default_factory=asyncio.Event)  # set when events grow or the run ends

    @property
    def running(self) -> bool:
        return not self.done

    @property
    def size(self) -> int:
        return (
            len(self.response.model_dump_json())
            + sum(len(message.model_dump_json()) for message in self.conversation)
            + sum(map(len, self.events or []))
        )

    def append(self, event: str) -> None:
        self.events.append(event)
        self.wake()

    def wake(self) -> None:
        """Wake every follower; each waits on the event it saw, so none misses a change."""
        self.grown.set()
        self.grown = asyncio.Event()

    async def follow(self, after: int | None) -> AsyncGenerator[str, None]:
        """The stream's events after sequence number `after` (from the first without it), then
        each as it comes, until the run ends."""
        index = 0 if after is None else after + 1
        while True:
            grown = self.grown
            while index < len(self.events):
                yield self.events[index]
                index += 1
            if not self.running:
                return
            await grown.wait()


class ResponseStore:
    """Stored responses by id, least recently used first, within `max_bytes` (0: none kept)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.sizes: dict[str, int] = {}  # of finished entries, counted against the budget
        self.num_bytes = 0  # their sum

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def num_running(self) -> int:
        return sum(entry.running for entry in self.entries.values())

    def add(self, entry: StoredResponse) -> None:
        self.entries[entry.response.id] = entry
        if not entry.running:
            self.finished(entry)

    def finished(self, entry: StoredResponse) -> None:
        """Count a response whose run ended, then drop the least recently used past the budget."""
        if entry.response.id not in self.entries:
            return  # deleted while it ran
        size = self.sizes[entry.response.id] = entry.size
        self.num_bytes += size
        if self.num_bytes > self.max_bytes:
            for response_id in [key for key in self.entries if key in self.sizes]:
                self.delete(response_id)
                if self.num_bytes <= self.max_bytes:
                    break

    def get(self, response_id: str, param: str = "response_id") -> StoredResponse:
        entry = self.entries.get(response_id)
        if entry is None:
            raise APIError(404, f"no response with id {response_id!r} is stored", param)
        self.entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> None:
        del self.entries[response_id]
        self.num_bytes -= self.sizes.pop(response_id, 0)
