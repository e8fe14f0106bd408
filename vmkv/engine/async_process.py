"""`AsyncProcessLLM`: the streaming interface of `AsyncLLM`, with the engine in its own process.

In one process, every token's detokenization, JSON and SSE framing competes with the
model for the interpreter lock; here the engine-core process (engine_core.py) only steps,
and this side, inside the server's event loop, tokenizes, detokenizes and answers HTTP.
The engine is spawned (never forked after torch has started threads) and reports ready
with the facts needed to validate requests here. Commands leave in one message per
event-loop turn; outputs arrive as one message per engine step (ipc.py).

Everything runs on the event loop of the first caller, except `abort`, `stats`,
`dead_reason` and `shutdown`, which are safe from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace

import msgspec
import zmq
import zmq.asyncio

from vmkv.engine.async_engine import EngineDead
from vmkv.engine.config import EngineConfig
from vmkv.engine.errors import RequestRejected
from vmkv.engine.ipc import (
    Abort,
    AddRequest,
    Command,
    EngineFailed,
    Ready,
    Shutdown,
    StartFailed,
    StopSample,
    encoder,
    new_addresses,
    output_decoder,
    read_start_report,
)
from vmkv.engine.llm_engine import EngineStats
from vmkv.engine.output_processor import RequestState
from vmkv.engine.outputs import RequestOutput
from vmkv.engine.sampling_params import SamplingParams
from vmkv.model.store import load_tokenizer, resolve_model

logger = logging.getLogger(__name__)
START_TIMEOUT_SECONDS = 600.0  # loading a model (and compiling it) can take minutes
STOP_TIMEOUT_SECONDS = 10.0


class EngineStartError(RuntimeError):
    """The engine process failed before it was ready; the message says why."""


@dataclass
class _Stream:
    state: RequestState
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)


class AsyncProcessLLM:
    def __init__(self, config: EngineConfig | None = None, **kwargs: object) -> None:
        config = config or EngineConfig(**kwargs)
        model_path = resolve_model(config.model)  # pull and convert here once, not in the child
        self.tokenizer = load_tokenizer(model_path)
        commands_address, outputs_address = new_addresses()
        # The engine binds, this side connects: a connecting PUSH queues from the start, so a send
        # never waits for the engine (no high-water mark either). Commands leave through a plain
        # socket, outputs arrive through an asyncio one.
        self._context = zmq.Context()
        self._commands = self._context.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.SNDHWM, 0)
        self._commands.connect(commands_address)
        self._async_context = zmq.asyncio.Context()
        self._outputs = self._async_context.socket(zmq.PULL)
        self._outputs.connect(outputs_address)
        # A fresh interpreter (never a fork of one whose torch threads exist), which needs no
        # `if __name__ == "__main__"` guard in the caller's script, unlike multiprocessing's spawn.
        # The child holds the write end of `ready_fd` until it dies: its end marks the death.
        self._ready_fd, child_fd = os.pipe()
        config = replace(config, model=str(model_path))
        self._process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vmkv.engine.engine_core",
                f"--config={msgspec.json.encode(config).decode()}",
                f"--commands={commands_address}",
                f"--outputs={outputs_address}",
                f"--ready-fd={child_fd}",
                f"--parent-pid={os.getpid()}",
            ],
            pass_fds=(child_fd,),
        )
        os.close(child_fd)
        self._streams: dict[str, _Stream] = {}
        self._pending: list[Command] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: asyncio.Task | None = None
        self._dead_reason: str | None = None
        self._closed = False
        report = read_start_report(self._ready_fd, time.monotonic() + START_TIMEOUT_SECONDS)
        if not isinstance(report, Ready):
            self.shutdown()
            if isinstance(report, StartFailed):
                raise EngineStartError(f"the engine process could not start: {report.reason}")
            if self._process.poll() is not None:
                raise EngineStartError(f"the engine process exited ({self._exit_text()}) before it was ready")
            raise EngineStartError(f"the engine process was not ready after {START_TIMEOUT_SECONDS:.0f} s")
        self.info, self._stats = report.info, report.stats

    @property
    def pid(self) -> int:
        """The engine process's id."""
        return self._process.pid

    # ------------------------------------------------------------ requests
    def validate(self, prompt: str | Sequence[int], params: SamplingParams) -> tuple[str | None, list[int]]:
        """Tokenize and check a request here (raises RequestRejected); nothing reaches the engine."""
        return self.info.validate(self.tokenizer, prompt, params)

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """As AsyncLLM.generate: the request's cumulative output after every step that advanced it.

        Raises RequestRejected on the first iteration if the request can never run, EngineDead
        if the engine process has stopped or stops meanwhile. Leaving early aborts the request.
        """
        params = params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        text, prompt_ids = self.validate(prompt, params)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise RequestRejected(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        self._start_reading()
        if (reason := self.dead_reason) is not None:
            raise EngineDead(reason)
        if request_id in self._streams:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        stream = self._streams[request_id] = _Stream(
            RequestState(request_id, text, prompt_ids, params, self.tokenizer)
        )
        self._send(AddRequest(request_id, prompt_ids, params, cache_salt))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine has forgotten it already
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._send(Abort(request_id))

    def abort(self, request_id: str) -> None:
        """Stop a request; its stream (if still read) gets a final output with finish_reason abort."""
        if self._loop is None:
            return  # nothing was ever submitted
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing runs any more
            self._loop.call_soon_threadsafe(self._send, Abort(request_id))

    def stats(self) -> EngineStats:
        """The engine's state after its latest step (or the latest command it took)."""
        return self._stats

    @property
    def dead_reason(self) -> str | None:
        """Why the engine stopped (shut down, crashed, killed); None while it runs."""
        if self._dead_reason is None and self._process.poll() is not None:
            return f"the engine process exited ({self._exit_text()})"
        return self._dead_reason

    def shutdown(self) -> None:
        """Stop the engine process (politely, then SIGTERM, then SIGKILL) and fail open streams."""
        if self._closed:
            return
        self._closed = True
        self._dead_reason = self._dead_reason or "the engine has been shut down"
        with contextlib.suppress(zmq.ZMQError):
            self._commands.send(encoder.encode([Shutdown()]), flags=zmq.NOBLOCK)
        for stop in (lambda: None, self._process.terminate, self._process.kill):
            if self._process.poll() is None:
                stop()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._process.wait(STOP_TIMEOUT_SECONDS)
        self._on_loop(self._close_streams)
        self._context.destroy(linger=0)

    def _on_loop(self, work: Callable[[], None]) -> None:
        """Run `work` on the event loop this object is bound to, and wait for it."""
        loop = self._loop
        if loop is None or loop.is_closed() or not loop.is_running():
            work()
            return
        with contextlib.suppress(RuntimeError):
            if asyncio.get_running_loop() is loop:
                work()
                return
        done = threading.Event()

        def run() -> None:
            try:
                work()
            finally:
                done.set()

        with contextlib.suppress(RuntimeError):  # closed meanwhile: nobody is left to tell
            loop.call_soon_threadsafe(run)
            done.wait(STOP_TIMEOUT_SECONDS)

    def _close_streams(self) -> None:
        """Fail what still streams, stop reading, close the output socket (on the loop)."""
        self._fail_all(self._dead_reason or "the engine has been shut down")
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._ready_fd)
        self._async_context.destroy(linger=0)
        os.close(self._ready_fd)

    # ------------------------------------------------------------ the event-loop side
    def _start_reading(self) -> None:
        """Bind to the caller's event loop: read outputs, and notice at once if the process dies."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._reader = self._loop.create_task(self._read_outputs())
        self._loop.add_reader(self._ready_fd, self._on_process_exit)

    async def _read_outputs(self) -> None:
        try:
            while True:
                message = output_decoder.decode(await self._outputs.recv(copy=False))
                if isinstance(message, EngineFailed):
                    self._die(message.reason)
                    return
                self._stats = message.stats
                for update in message.updates:
                    stream = self._streams.get(update.request_id)
                    if stream is None or stream.state.finished:
                        continue  # its stream is gone or complete; the engine caught up
                    if update.rejected is not None:
                        stream.state.finished = True
                        stream.queue.put_nowait(RequestRejected(update.rejected))
                        continue
                    for index in stream.state.apply(update):
                        self._send(StopSample(update.request_id, index))
                    stream.queue.put_nowait(stream.state.output())
        except (asyncio.CancelledError, zmq.ZMQError):
            return

    def _on_process_exit(self) -> None:
        assert self._loop is not None
        self._loop.remove_reader(self._ready_fd)
        self._process.wait()
        self._die(self._dead_reason or f"the engine process exited ({self._exit_text()})")

    def _die(self, reason: str) -> None:
        if self._dead_reason is None:
            logger.error("engine stopped: %s", reason)
        self._dead_reason = self._dead_reason or reason
        self._fail_all(self._dead_reason)

    def _fail_all(self, reason: str) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.queue.put_nowait(EngineDead(reason))
        if self._reader is not None:
            self._reader.cancel()

    def _send(self, command: Command) -> None:
        """Queue a command; everything queued in one event-loop turn leaves as one message."""
        if self._closed:
            return
        self._pending.append(command)
        if len(self._pending) == 1:
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        commands, self._pending = self._pending, []
        if commands and not self._closed:
            self._commands.send(encoder.encode(commands), flags=zmq.NOBLOCK)

    def _exit_text(self) -> str:
        code = self._process.returncode
        if code is not None and code < 0:
            return f"killed by signal {-code}"
        return f"exit code {code}"
