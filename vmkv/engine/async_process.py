"""`AsyncProcessLLM`: the streaming interface of `AsyncLLM`, with the engine in its own process.

In one process, every token's detokenization, JSON and SSE framing competes with the
model for the interpreter lock; here the engine-core process (engine_core.py) only steps,
and this side tokenizes, detokenizes and answers HTTP. The engine is a fresh interpreter
(never a fork of one whose torch threads exist) and reports ready with the facts needed to
validate requests here. Commands leave as they come; outputs arrive as one message per
engine step (ipc.py).

A reader thread receives each step's message (releasing the interpreter lock while it
waits) and hands every event loop with streams in it that step's updates in one call; the
text is made there, on the stream's own loop. So any number of event loops may use one
engine, one after another or at once, and every method is safe from any thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace

import msgspec
import torch
import zmq

from vmkv.engine.async_engine import EngineDead, outputs_until_finished
from vmkv.engine.config import EngineConfig
from vmkv.engine.errors import RequestRejected
from vmkv.engine.ipc import (
    Abort,
    AddRequest,
    Command,
    Control,
    ControlAnswer,
    EngineFailed,
    Ready,
    RequestUpdate,
    Shutdown,
    StartFailed,
    StopSample,
    encoder,
    new_addresses,
    output_decoder,
    read_start_report,
)
from vmkv.engine.llm_engine import EngineStats
from vmkv.engine.logits_processors import check_extra_args, logits_processor_class
from vmkv.engine.lora import LoRARequest
from vmkv.engine.output_processor import RequestState
from vmkv.engine.outputs import RequestOutput
from vmkv.engine.prompt_embeds import EmbedsPayload, prompt_rows
from vmkv.engine.sampling_params import SamplingParams
from vmkv.model.store import load_tokenizer, resolve_model

logger = logging.getLogger(__name__)
START_TIMEOUT_SECONDS = 600.0  # loading a model (and compiling it) can take minutes
STOP_TIMEOUT_SECONDS = 10.0


class EngineStartError(RuntimeError):
    """The engine process failed before it was ready; the message says why."""


@dataclass(eq=False)
class _Stream:
    state: RequestState
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncProcessLLM:
    def __init__(self, config: EngineConfig | None = None, **kwargs: object) -> None:
        config = config or EngineConfig(**kwargs)
        model_path = resolve_model(config.model)  # pull and convert here once, not in the child
        # their classes, to check a request's extra_args here (an unusable one fails here first)
        self._processors = [logits_processor_class(name) for name in config.logits_processors]
        self.tokenizer = load_tokenizer(model_path)
        commands_address, outputs_address = new_addresses()
        # The engine binds, this side connects: a connecting PUSH queues from the start, so a
        # send never waits for the engine (no high-water mark either).
        self._context = zmq.Context()
        self._commands = self._context.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.SNDHWM, 0)
        self._commands.connect(commands_address)
        self._outputs = self._context.socket(zmq.PULL)
        self._outputs.connect(outputs_address)
        # `python -m` needs no `if __name__ == "__main__"` guard in the caller's script, unlike
        # multiprocessing's spawn. The child holds the write end of this pipe until it dies.
        self._death_fd, child_fd = os.pipe()
        self._process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vmkv.engine.engine_core",
                f"--config={msgspec.json.encode(replace(config, model=str(model_path))).decode()}",
                f"--commands={commands_address}",
                f"--outputs={outputs_address}",
                f"--ready-fd={child_fd}",
                f"--parent-pid={os.getpid()}",
            ],
            pass_fds=(child_fd,),
        )
        os.close(child_fd)
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams, _calls, _dead_reason and the commands socket
        self._calls: dict[str, concurrent.futures.Future] = {}  # control calls awaiting their answer
        self._dead_reason: str | None = None
        self._closed = False
        self._reader: threading.Thread | None = None
        report = read_start_report(self._death_fd, time.monotonic() + START_TIMEOUT_SECONDS)
        if not isinstance(report, Ready):
            self.shutdown()
            if isinstance(report, StartFailed):
                raise EngineStartError(f"the engine process could not start: {report.reason}")
            if self._process.poll() is not None:
                raise EngineStartError(f"the engine process exited ({self._exit_text()}) before it was ready")
            raise EngineStartError(f"the engine process was not ready after {START_TIMEOUT_SECONDS:.0f} s")
        self.info, self._stats = report.info, report.stats
        self._reader = threading.Thread(target=self._read_outputs, name="vmkv-engine-outputs", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        """The engine process's id."""
        return self._process.pid

    # ------------------------------------------------------------ requests
    def validate(
        self, prompt: str | Sequence[int] | torch.Tensor, params: SamplingParams
    ) -> tuple[str | None, list[int]]:
        """Tokenize and check a request here (raises RequestRejected); nothing reaches the engine."""
        check_extra_args(self._processors, params)
        return self.info.validate(self.tokenizer, prompt, params)

    async def generate(
        self,
        prompt: str | Sequence[int] | torch.Tensor,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
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
        self.info.check_priority(priority)
        embeds = prompt_rows(prompt) if isinstance(prompt, torch.Tensor) else None  # validated above
        state = RequestState(
            request_id, text, prompt_ids, params, self.tokenizer, embedded=embeds is not None
        )
        stream = _Stream(state, asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            # checked under the lock _die takes: a stream is either refused here or failed there
            if (reason := self.dead_reason) is not None:
                raise EngineDead(reason)
            if request_id in self._streams:
                raise RequestRejected(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
            payload = None if embeds is None else EmbedsPayload.of(embeds)
            self._send_locked(
                AddRequest(request_id, prompt_ids, params, cache_salt, priority, payload, lora_request)
            )
        finished = False
        try:
            async for item in outputs_until_finished(stream.queue):
                finished = item.finished
                yield item
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
                if not finished:
                    self._send_locked(Abort(request_id))

    async def reset_prefix_cache(self) -> int:
        """Forget every cached prefix in the engine process; returns the entries forgotten.
        Raises EngineDead if the engine has stopped or stops before it answers."""
        return await self.control("reset_prefix_cache")  # type: ignore[return-value]

    async def control(self, name: str, *args: object) -> object:
        """As AsyncLLM.control, in the engine process."""
        call_id, done = uuid.uuid4().hex, concurrent.futures.Future()
        with self._lock:
            if (reason := self.dead_reason) is not None:
                raise EngineDead(reason)
            self._calls[call_id] = done
            self._send_locked(Control(call_id, name, list(args)))
        answer = await asyncio.wrap_future(done)
        return answer.value()

    def abort(self, request_id: str) -> None:
        """Stop a request; its stream (if still read) gets a final output with finish_reason abort."""
        with self._lock:
            self._send_locked(Abort(request_id))

    def stats(self) -> EngineStats:
        """The engine's state after its latest step (or the latest commands it took)."""
        return self._stats

    @property
    def dead_reason(self) -> str | None:
        """Why the engine stopped (shut down, crashed, killed); None while it runs."""
        if self._dead_reason is None and self._process.poll() is not None:
            return f"the engine process exited ({self._exit_text()})"
        return self._dead_reason

    def shutdown(self) -> None:
        """Stop the engine process (politely, then SIGTERM, then SIGKILL) and fail open streams."""
        with self._lock:
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
        self._die("the engine has been shut down")
        if self._reader is not None:
            self._reader.join()  # it ends once it sees the death pipe close
        self._context.destroy(linger=0)
        os.close(self._death_fd)

    # ------------------------------------------------------------ the reader thread
    def _read_outputs(self) -> None:
        poller = zmq.Poller()
        poller.register(self._outputs, zmq.POLLIN)
        poller.register(self._death_fd, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._outputs in ready:
                message = output_decoder.decode(self._outputs.recv(copy=False).buffer)
                if isinstance(message, EngineFailed):
                    self._die(message.reason)
                    continue
                if isinstance(message, ControlAnswer):
                    with self._lock:
                        done = self._calls.pop(message.call_id, None)
                    if done is not None:
                        done.set_result(message)
                    continue
                self._stats = message.stats
                self._dispatch(message.updates)
            elif self._death_fd in ready:  # the engine process has ended
                self._process.wait()
                self._die(f"the engine process exited ({self._exit_text()})")
                return

    def _dispatch(self, updates: list[RequestUpdate]) -> None:
        """Hand each event loop its streams' updates of this step, in one call per loop."""
        per_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestUpdate]]] = {}
        with self._lock:
            for update in updates:
                stream = self._streams.get(update.request_id)
                if stream is not None:
                    per_loop.setdefault(stream.loop, []).append((stream, update))
        for loop, items in per_loop.items():
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody listens
                loop.call_soon_threadsafe(self._apply, items)

    def _apply(self, items: list[tuple[_Stream, RequestUpdate]]) -> None:
        """On the streams' loop: make text, apply stop strings, deliver cumulative outputs."""
        for stream, update in items:
            state = stream.state
            if state.finished:
                continue  # complete here already (a stop string); the engine caught up
            if update.rejected is not None:
                state.finished = True
                stream.queue.put_nowait(RequestRejected(update.rejected, update.rejected_param))
                continue
            for index in state.apply(update):
                self._send(StopSample(state.request_id, index))
            stream.queue.put_nowait(state.output())

    def _die(self, reason: str) -> None:
        """Refuse new streams and fail every open one with EngineDead(reason)."""
        with self._lock:
            if self._dead_reason is None:
                logger.error("engine stopped: %s", reason)
            self._dead_reason = self._dead_reason or reason
            streams, self._streams = self._streams, {}
            calls, self._calls = self._calls, {}
        for done in calls.values():
            done.set_exception(EngineDead(self._dead_reason))
        for stream in streams.values():
            with contextlib.suppress(RuntimeError):
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, EngineDead(self._dead_reason))

    def _send(self, command: Command) -> None:
        with self._lock:
            self._send_locked(command)

    def _send_locked(self, command: Command) -> None:
        if not self._closed:
            self._commands.send(encoder.encode([command]), flags=zmq.NOBLOCK)

    def _exit_text(self) -> str:
        code = self._process.returncode
        if code is not None and code < 0:
            return f"killed by signal {-code}"
        return f"exit code {code}"
