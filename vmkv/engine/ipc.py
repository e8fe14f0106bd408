"""The messages between the API process and the engine-core process, and their encoding.

Two ZeroMQ sockets, both bound by the engine (the API process connects, so its sends queue
from the start): commands go PUSH -> PULL to the engine, outputs come back PUSH -> PULL.
Each message is one msgpack frame (msgspec, with the structs below as arrays, so field names
are not sent): the API process sends each command as it comes, the engine one `StepOutputs`
after every step and after every batch of commands it took. Outputs carry only what is new
since the last message, as token ids: the API process detokenizes.
"""

from __future__ import annotations

import os
import select
import time
import uuid
from typing import Any, BinaryIO

import msgspec

from vmkv.engine.engine_info import EngineInfo
from vmkv.engine.errors import ControlRefused
from vmkv.engine.llm_engine import EngineStats
from vmkv.engine.lora import LoRARequest
from vmkv.engine.outputs import PromptLogprob
from vmkv.engine.prompt_embeds import EmbedsPayload
from vmkv.engine.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    priority: int = 0
    prompt_embeds: EmbedsPayload | None = None  # the prompt itself, its token ids placeholders
    lora_request: LoRARequest | None = None


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_id: str


class StopSample(msgspec.Struct, tag=True, array_like=True):
    """Sample `index` of a request met a stop string (only the API process sees text)."""

    request_id: str
    index: int


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


class Control(msgspec.Struct, tag=True, array_like=True):
    """An operator's call (LLMEngine.control); answered by ControlAnswer with the same call id."""

    call_id: str
    name: str
    args: list[Any]


Command = AddRequest | Abort | StopSample | Shutdown | Control


class SampleUpdate(msgspec.Struct, array_like=True):
    index: int
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    # a stop token id, or "repetition_detected"; stop strings are found by the API process
    stop_reason: int | str | None
    cumulative_logprob: float | None  # with logprobs, or a beam search's answer


class RequestUpdate(msgspec.Struct, array_like=True):
    request_id: str
    samples: list[SampleUpdate]
    finished: bool
    error: str | None = None  # the engine failed the request (finish_reason "error")
    rejected: str | None = None  # the engine refused it at admission: nothing ran
    rejected_param: str | None = None  # the field to blame, as RequestRejected.param
    prompt_logprobs: list[PromptLogprob | None] | None = None  # sent once, when complete
    num_cached_tokens: int = 0
    embedding: list[float] | None = None  # a pooling request's, when it finishes


class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    updates: list[RequestUpdate]
    stats: EngineStats


class EngineFailed(msgspec.Struct, tag=True, array_like=True):
    """The engine loop cannot go on; the process exits after sending this."""

    reason: str


class ControlAnswer(msgspec.Struct, tag=True, array_like=True):
    call_id: str
    result: Any
    error: str | None = None
    error_kind: str = ""  # "invalid" (ValueError), "refused" (ControlRefused) or "failed"

    @classmethod
    def of(cls, call_id: str, result: object, error: BaseException | None) -> ControlAnswer:
        if error is None:
            return cls(call_id, result)
        kind = "invalid" if isinstance(error, ValueError) else "failed"
        return cls(call_id, None, str(error), "refused" if isinstance(error, ControlRefused) else kind)

    def value(self) -> object:
        """The result, or the error raised as its kind."""
        if self.error is None:
            return self.result
        if self.error_kind == "invalid":
            raise ValueError(self.error)
        if self.error_kind == "refused":
            raise ControlRefused(self.error)
        raise RuntimeError(f"the engine's call failed: {self.error}")


Output = StepOutputs | EngineFailed | ControlAnswer


class Ready(msgspec.Struct, tag=True):
    """Sent once through the start-up pipe: the engine is built and listening."""

    info: EngineInfo
    stats: EngineStats


class StartFailed(msgspec.Struct, tag=True):
    reason: str


StartReport = Ready | StartFailed

encoder = msgspec.msgpack.Encoder()
command_decoder = msgspec.msgpack.Decoder(list[Command])
output_decoder = msgspec.msgpack.Decoder(Output)
start_decoder = msgspec.msgpack.Decoder(StartReport)
LENGTH_BYTES = 8


def write_start_report(pipe: BinaryIO, report: StartReport) -> None:
    """One length-prefixed frame: the pipe stays open after it, so its end cannot mark the end."""
    payload = encoder.encode(report)
    pipe.write(len(payload).to_bytes(LENGTH_BYTES, "little") + payload)
    pipe.flush()


def read_start_report(fd: int, deadline: float) -> StartReport | None:
    """The report from the start-up pipe, waiting until the monotonic `deadline`; None if the
    pipe closed first (the engine process died) or the deadline passed."""
    data = b""
    while True:
        if len(data) >= LENGTH_BYTES:
            size = int.from_bytes(data[:LENGTH_BYTES], "little")
            if len(data) >= LENGTH_BYTES + size:
                return start_decoder.decode(data[LENGTH_BYTES : LENGTH_BYTES + size])
        timeout = deadline - time.monotonic()
        if timeout <= 0 or not select.select([fd], [], [], timeout)[0]:
            return None
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return None
        data += chunk


def new_addresses() -> tuple[str, str]:
    """(commands, outputs) addresses in Linux's abstract socket namespace: no file to leak."""
    base = f"ipc://@vmkv-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    return f"{base}-commands", f"{base}-outputs"
