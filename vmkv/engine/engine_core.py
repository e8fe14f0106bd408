"""The engine-core process: one LLMEngine stepping as fast as it can, fed and drained over ZeroMQ.

It owns the model, the KV cache and the scheduler, and does nothing per token but sample:
no detokenization, no JSON, no HTTP. A receiver thread decodes commands as they arrive and
tells the engine of new prompts at once, so the KV cache may back them while a step computes;
between steps the loop applies every command that arrived (without waiting while it has work),
and after a step it sends one message with every request's new token ids and the engine's
stats. It exits when told to, on SIGTERM, or when the API process that started it is gone.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import threading
import time
from functools import partial

import msgspec
import zmq

from vmkv.distributed.errors import TensorParallelError
from vmkv.engine.config import EngineConfig
from vmkv.engine.errors import RequestRejected
from vmkv.engine.gc_heap import freeze_start_up_heap
from vmkv.engine.ipc import (
    Abort,
    AddRequest,
    Command,
    Control,
    ControlAnswer,
    EngineFailed,
    Ready,
    RequestUpdate,
    SampleUpdate,
    Shutdown,
    StartFailed,
    StepOutputs,
    StopSample,
    command_decoder,
    encoder,
    write_start_report,
)
from vmkv.engine.llm_engine import KV_STATS_MAX_AGE, LLMEngine
from vmkv.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)
PARENT_CHECK_SECONDS = 1.0
HEALTH_CHECK_MS = 1000  # an idle engine notices a lost tensor-parallel rank within this
RECEIVE_POLL_MS = 100  # the receiver thread notices close() within this


def main(argv: list[str] | None = None) -> None:
    """Entry point of the engine process (`python -m vmkv.engine.engine_core`, started by
    AsyncProcessLLM): build the engine, write Ready or StartFailed to the start-up pipe, serve
    until shut down. The pipe stays open until this process ends, so the API process sees the
    end of it as this process's death."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    parser.add_argument("--commands", required=True, help="address of the commands socket")
    parser.add_argument("--outputs", required=True, help="address of the outputs socket")
    parser.add_argument("--ready-fd", type=int, required=True, help="write end of the start-up pipe")
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="vmkv engine: %(message)s")
    # Ctrl-C reaches the whole process group; the API process decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    _exit_with_parent(args.parent_pid)
    ready = os.fdopen(args.ready_fd, "wb", buffering=0)
    try:
        engine = LLMEngine(msgspec.json.decode(args.config, type=EngineConfig), detokenize=False)
    except BaseException as error:
        write_start_report(ready, StartFailed(f"{type(error).__name__}: {error}"))
        raise
    core = EngineCore(engine, args.commands, args.outputs)
    freeze_start_up_heap()
    try:
        write_start_report(ready, Ready(engine.info, engine.stats()))
        core.run()
    finally:
        core.close()


class EngineCore:
    def __init__(self, engine: LLMEngine, commands_address: str, outputs_address: str) -> None:
        self.engine = engine
        self.context = zmq.Context()
        self.commands = self.context.socket(zmq.PULL)
        self.commands.bind(commands_address)
        self.outputs = self.context.socket(zmq.PUSH)
        self.outputs.setsockopt(zmq.SNDHWM, 0)  # never block a step on a slow reader
        self.outputs.bind(outputs_address)
        self.sent: dict[str, dict[int, int]] = {}  # request id -> sample index -> tokens sent
        self.prompt_logprobs_sent: set[str] = set()
        self.running = True
        # commands decoded as they arrive, in order (or the error that stopped the receiver)
        self.inbox: queue.SimpleQueue[list[Command] | BaseException] = queue.SimpleQueue()
        self._stop_receiving = threading.Event()
        self._receiver = threading.Thread(target=self._receive_commands, name="vmkv-commands", daemon=True)
        self._receiver.start()

    def run(self) -> None:
        try:
            while self.running:
                busy = self.engine.has_work()
                outputs = self.receive(wait=not busy)
                if self.running and self.engine.has_work():
                    outputs += self.step()
                self.engine.settle()
                self.send(outputs)
        except TensorParallelError as error:  # a rank is gone: this engine can never step again
            self.outputs.send(encoder.encode(EngineFailed(str(error))))
            raise

    def receive(self, wait: bool) -> list[RequestOutput | RequestUpdate]:
        """Apply every command that has arrived; block for the first one only if `wait`
        (checking the engine's health while it waits)."""
        outputs: list[RequestOutput | RequestUpdate] = []
        block = wait
        while self.running:
            try:
                item = self.inbox.get(timeout=HEALTH_CHECK_MS / 1000) if block else self.inbox.get_nowait()
            except queue.Empty:
                if not block:
                    break
                self.engine.check_health()
                continue
            if isinstance(item, BaseException):
                raise item
            for command in item:
                outputs += self.apply(command)
            block = False
        return outputs

    def _receive_commands(self) -> None:
        """The receiver thread: decode commands as they arrive, even while a step computes, and
        tell the engine of new prompts at once, so the KV cache can back their memory before
        the step that admits them (LLMEngine.prompts_arrived). Only this thread touches the
        commands socket."""
        try:
            while not self._stop_receiving.is_set():
                if not self.commands.poll(RECEIVE_POLL_MS):
                    continue
                commands = command_decoder.decode(self.commands.recv(copy=False).buffer)
                prompts = [
                    (c.prompt_token_ids, c.cache_salt)
                    for c in commands
                    if isinstance(c, AddRequest) and c.prompt_embeds is None
                ]
                if prompts:
                    self.engine.prompts_arrived(prompts)
                self.inbox.put(commands)
                if any(isinstance(c, Shutdown) for c in commands):
                    return
        except BaseException as error:  # the loop raises it: a dead receiver must not look idle
            self.inbox.put(error)

    def apply(self, command: Command) -> list[RequestOutput | RequestUpdate]:
        engine = self.engine
        match command:
            case AddRequest(request_id, prompt_ids, params, cache_salt, priority, embeds, lora_request):
                prompt = prompt_ids if embeds is None else embeds.tensor()
                try:
                    engine.add_request(request_id, prompt, params, cache_salt, priority, lora_request)
                except RequestRejected as error:
                    refusal = {"rejected": str(error), "rejected_param": error.param}
                    return [RequestUpdate(request_id, [], finished=True, **refusal)]
                self.sent[request_id] = {}
                return []
            case Abort(request_id):
                out = engine.abort_request(request_id)
            case StopSample(request_id, index):
                out = engine.stop_sample(request_id, index)
            case Shutdown():
                self.running = False
                out = None
            case Control(call_id, name, args):
                return engine.control(name, args, partial(self.answer, call_id))
        return [] if out is None else [out]

    def answer(self, call_id: str, result: object, error: BaseException | None) -> None:
        """A control call's answer, sent at once (before the outputs of the commands' batch)."""
        self.outputs.send(encoder.encode(ControlAnswer.of(call_id, result, error)))

    def step(self) -> list[RequestOutput]:
        try:
            return self.engine.step()
        except Exception as error:  # fail the requests in flight, keep serving
            logger.exception("engine step failed")
            try:
                return self.engine.fail_all(f"engine step failed: {error!r}")
            except Exception as cleanup:
                reason = f"engine step failed ({error!r}) and cleanup failed ({cleanup!r})"
                self.outputs.send(encoder.encode(EngineFailed(reason)))
                raise

    def send(self, outputs: list[RequestOutput | RequestUpdate]) -> None:
        updates = [out if isinstance(out, RequestUpdate) else self.update(out) for out in outputs]
        busy = self.engine.has_unfinished_requests()  # idle, the figures are exact
        stats = self.engine.stats(kv_max_age=KV_STATS_MAX_AGE if busy else 0.0)
        self.outputs.send(encoder.encode(StepOutputs(updates, stats)), copy=False)

    def update(self, out: RequestOutput) -> RequestUpdate:
        """What is new in a request's cumulative output since the last message."""
        sent = self.sent.pop(out.request_id, {}) if out.finished else self.sent[out.request_id]
        samples = []
        for sample in out.outputs:
            start = sent.get(sample.index, 0)
            sent[sample.index] = len(sample.token_ids)
            samples.append(
                SampleUpdate(
                    sample.index,
                    sample.token_ids[start:],
                    None if sample.logprobs is None else sample.logprobs[start:],
                    sample.finish_reason,
                    sample.stop_reason,
                    sample.cumulative_logprob,
                )
            )
        prompt_logprobs = None
        if out.prompt_logprobs is not None and out.request_id not in self.prompt_logprobs_sent:
            prompt_logprobs = out.prompt_logprobs
            self.prompt_logprobs_sent.add(out.request_id)
        if out.finished:
            self.prompt_logprobs_sent.discard(out.request_id)
        return RequestUpdate(
            out.request_id,
            samples,
            out.finished,
            error=out.error,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=out.num_cached_tokens,
            embedding=out.embedding,
        )

    def close(self) -> None:
        self._stop_receiving.set()
        self._receiver.join()
        self.engine.close()
        self.context.destroy(linger=0)


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _exit_with_parent(parent_pid: int) -> None:
    """Stop (as on SIGTERM) once the API process is gone, even if it was killed outright:
    an orphaned engine would hold its KV memory and its cores forever."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_CHECK_SECONDS)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="vmkv-parent-watch", daemon=True).start()


if __name__ == "__main__":
    main()
