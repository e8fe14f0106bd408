"""`AsyncLLM`: the streaming interface a server uses, with the engine stepping on its own thread.

Requests and aborts reach the engine thread through a queue; outputs come back to each
request's asyncio queue through its event loop. Only the engine thread changes the
engine, so the engine itself needs no locks; callers only validate a request and tell the
KV cache it arrived (both thread-safe). Leaving a stream early aborts its request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from vmkv.engine.config import EngineConfig
from vmkv.engine.engine_info import EngineInfo
from vmkv.engine.errors import RequestRejected
from vmkv.engine.llm_engine import KV_STATS_MAX_AGE, EngineStats, LLMEngine
from vmkv.engine.lora import LoRARequest
from vmkv.engine.outputs import RequestOutput
from vmkv.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def _answer(done: concurrent.futures.Future, result: object, error: BaseException | None) -> None:
    """A control call's answer into its future, unless _die failed it first."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if error is None:
            done.set_result(result)
        else:
            done.set_exception(error)


class EngineDead(RuntimeError):
    """The engine has stopped (shutdown or a crash); no request can be served."""


async def outputs_until_finished(
    queue: asyncio.Queue[RequestOutput | BaseException],
) -> AsyncIterator[RequestOutput]:
    """A stream's outputs until its finished one; an exception put in the queue is raised."""
    while True:
        item = await queue.get()
        if isinstance(item, BaseException):
            raise item
        yield item
        if item.finished:
            return


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncLLM:
    def __init__(self, config: EngineConfig | None = None, **kwargs: object) -> None:
        self.engine = LLMEngine(config or EngineConfig(**kwargs))
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._calls: set[concurrent.futures.Future] = set()  # control calls awaiting their answer
        self._stats = self.engine.stats()  # refreshed by the engine thread; never half a step
        self._closed = False
        self.dead_reason: str | None = None  # why the engine stopped or is stopping; None while it runs
        self._thread = threading.Thread(target=self._run, name="vmkv-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):  # noqa: ANN201 - a transformers tokenizer
        return self.engine.tokenizer

    @property
    def info(self) -> EngineInfo:
        return self.engine.info

    def validate(self, prompt: str | Sequence[int], params: SamplingParams) -> tuple[str | None, list[int]]:
        """Tokenize and check a request without touching engine state (raises RequestRejected)."""
        return self.engine.validate(prompt, params)

    # ------------------------------------------------------------ requests
    async def generate(
        self,
        prompt: str | Sequence[int] | torch.Tensor,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative output after every step that advanced it, until finished.

        Raises RequestRejected on the first iteration if the request can never run, EngineDead
        if the engine thread has stopped or stops meanwhile. Closing the iterator early (client
        gone, cancellation) aborts the request and frees its KV. Cached prefixes are shared only
        among requests with the same cache_salt; under the priority policy a lower priority
        runs first; lora_request runs it with that LoRA adapter.
        """
        request_id = request_id or uuid.uuid4().hex
        stream = self._open_stream(
            request_id, prompt, params or SamplingParams(), cache_salt, priority, lora_request
        )
        finished = False
        try:
            async for item in outputs_until_finished(stream.queue):
                finished = item.finished
                yield item
        finally:
            with self._streams_lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def _open_stream(
        self,
        request_id: str,
        prompt: str | Sequence[int] | torch.Tensor,
        params: SamplingParams,
        cache_salt: str | None,
        priority: int,
        lora_request: LoRARequest | None,
    ) -> _Stream:
        """Validate in the caller's thread (raises RequestRejected), then queue the request."""
        self.info.check_priority(priority)
        text, prompt_ids = self.engine.validate(prompt, params)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._streams_lock:
            # checked under the lock _die takes: a stream is either refused here or failed there
            if self.dead_reason is not None:
                raise EngineDead(self.dead_reason)
            if request_id in self._streams:
                raise RequestRejected(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        if not isinstance(prompt, torch.Tensor):  # the cache may back it while a step computes
            self.engine.prompts_arrived([(prompt_ids, cache_salt)])
        prompt = prompt if text is None else text
        self._inbox.put(("add", request_id, prompt, params, cache_salt, priority, lora_request))
        self._wake.set()
        return stream

    async def reset_prefix_cache(self) -> int:
        """Forget every cached prefix, between two steps; returns the entries forgotten. Raises
        EngineDead if the engine has stopped or stops first."""
        return await self.control("reset_prefix_cache")  # type: ignore[return-value]

    async def control(self, name: str, *args: object) -> object:
        """An operator's call between two steps (LLMEngine.control: pause, sleep, wake_up, resume,
        reset_prefix_cache, state); returns its result or raises its error (ValueError for bad
        arguments), EngineDead if the engine has stopped or stops before it answers."""
        done: concurrent.futures.Future[object] = concurrent.futures.Future()
        with self._streams_lock:
            if self.dead_reason is not None:
                raise EngineDead(self.dead_reason)
            self._calls.add(done)
        self._inbox.put(("control", name, args, done))
        self._wake.set()
        try:
            return await asyncio.wrap_future(done)
        finally:
            with self._streams_lock:
                self._calls.discard(done)

    def abort(self, request_id: str) -> None:
        """Stop a request; its stream (if still read) gets a final output with finish_reason abort."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def stats(self) -> EngineStats:
        """The engine's state after its latest step, taken before that step's outputs are delivered
        (so it never waits for a running step)."""
        return self._stats

    def shutdown(self) -> None:
        """Stop the engine thread, fail what is still streaming, and free the KV cache (once)."""
        if self._closed:
            return
        self._closed = True
        self._die(self.dead_reason or "the engine has been shut down")
        self._wake.set()
        self._thread.join()
        self.engine.close()

    # --------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug outside a step: fail the streams rather than leave them waiting
            logger.exception("the engine thread crashed")
            self._die(f"the engine thread crashed: {exc!r}")

    def _loop(self) -> None:
        while self.dead_reason is None:
            self._drain_inbox()
            self.engine.settle()
            if not self.engine.has_work():
                self._stats = self.engine.stats()
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # keep serving: fail the requests in flight, not the server
                logger.exception("engine step failed")
                try:
                    outputs = self.engine.fail_all(f"engine step failed: {exc!r}")
                except Exception as cleanup:
                    logger.exception("could not free the failed requests; the engine stops")
                    self._die(f"engine step failed ({exc!r}) and cleanup failed ({cleanup!r})")
                    return
            self._stats = self.engine.stats(kv_max_age=KV_STATS_MAX_AGE)
            for out in outputs:
                self._deliver(out)

    def _die(self, reason: str) -> None:
        """Stop for good: refuse new streams and fail every open one with EngineDead(reason)."""
        self.dead_reason = reason
        with self._streams_lock:
            streams, self._streams = self._streams, {}
            calls, self._calls = self._calls, set()
        for stream in streams.values():
            self._put(stream, EngineDead(reason))
        for call in calls:
            with contextlib.suppress(concurrent.futures.InvalidStateError):  # it was answered first
                call.set_exception(EngineDead(reason))

    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if message[0] == "control":
                _, name, args, done = message
                for out in self.engine.control(name, args, partial(_answer, done)):
                    self._deliver(out)
            elif message[0] == "add":
                _, request_id, prompt, params, cache_salt, priority, lora_request = message
                try:
                    self.engine.add_request(request_id, prompt, params, cache_salt, priority, lora_request)
                except RequestRejected as exc:
                    self._deliver_error(request_id, exc)
            else:
                out = self.engine.abort_request(message[1])
                if out is not None:
                    self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        with self._streams_lock:
            stream = self._streams.get(out.request_id)
        if stream is not None:
            self._put(stream, out)

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        with self._streams_lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            self._put(stream, exc)

    @staticmethod
    def _put(stream: _Stream, item: RequestOutput | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # the caller's event loop is closed: nobody listens
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
