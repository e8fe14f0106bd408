"""The server's one view of the engine: submit token ids, async-iterate per-step deltas, abort.

The engine reports each request's samples cumulatively; HTTP streams send only what is
new, so this adapter turns outputs into deltas. A request's lifetime is tied to one async
generator: leaving it early, for any reason (client gone, error, cancellation), aborts the
request and frees its KV.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from vmkv.engine import (
    AsyncLLM,
    AsyncProcessLLM,
    CompletionOutput,
    DataParallelLLM,
    EngineDead,
    EngineStats,
    LoRARequest,
    RequestOutput,
    SamplingParams,
)
from vmkv.engine.outputs import PromptLogprob


class EngineDeadError(RuntimeError):
    """The engine has stopped; no request can be served until the server restarts."""


class RequestFailed(RuntimeError):
    """The engine could not run this request (a step failed); the engine itself keeps serving."""


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens at this position, best first


@dataclass
class SampleDelta:
    """What one sample (of n) gained in one engine step."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # the request's prompt logprobs, on each sample's delta of the step they arrive with
    prompt_logprobs: list[PromptLogprob | None] | None = None
    num_cached_tokens: int = 0  # the request's prompt tokens the prefix cache held


@dataclass
class _Sent:
    chars: int = 0
    tokens: int = 0
    finished: bool = False


class EngineClient:
    """Over either front door: AsyncLLM (engine on a thread) or AsyncProcessLLM (its own process)."""

    def __init__(self, llm: AsyncLLM | AsyncProcessLLM | DataParallelLLM) -> None:
        self.llm = llm
        self.tokenizer: PreTrainedTokenizerBase = llm.tokenizer
        self.max_model_len: int = llm.info.max_model_len
        self.vocab_size: int = min(len(self.tokenizer), llm.info.vocab_size)
        self.model_path = llm.info.model_path
        self.hidden_size: int = llm.info.hidden_size  # an embedding's dimensions
        # the LoRA adapters served, by the model name requests give for them
        self.loras: dict[str, LoRARequest] = {}
        self._next_lora_id = 1

    def lora_request(self, name: str | None) -> LoRARequest | None:
        """The adapter served under model name `name`, if one is."""
        return None if name is None else self.loras.get(name)

    async def add_lora(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Load an adapter in the engine and serve it as model `name` (replacing one served so:
        its cached prefixes are not reused). Raises ValueError for one the engine cannot load."""
        request = LoRARequest(name, self._next_lora_id, path, base_model_name)
        if name in self.loras:
            await self.control("remove_lora", name)
        await self.control("add_lora", name, path)
        self._next_lora_id += 1
        self.loras[name] = request
        return request

    async def remove_lora(self, name: str) -> bool:
        """Stop serving an adapter (requests running with it finish); whether it was served."""
        if self.loras.pop(name, None) is None:
            return False
        await self.control("remove_lora", name)
        return True

    def check_alive(self) -> None:
        """Raises EngineDeadError, saying why, once the engine has stopped (shut down, or its thread died)."""
        if self.llm.dead_reason is not None:
            raise _engine_dead(self.llm.dead_reason)

    def validate(self, prompt: list[int] | torch.Tensor, params: SamplingParams) -> None:
        """Raises RequestRejected for a request the engine could never run; changes nothing."""
        self.llm.validate(prompt, params)

    def check_priority(self, priority: int) -> None:
        """Raises RequestRejected for a priority the engine's scheduling policy cannot honour."""
        self.llm.info.check_priority(priority)

    async def generate(
        self,
        request_id: str,
        prompt: list[int] | torch.Tensor,
        params: SamplingParams,
        cache_salt: str | None = None,
        priority: int = 0,
        stream_interval: int = 1,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[list[SampleDelta], None]:
        """One list of deltas per engine step that advanced the request, until every sample ends.
        `prompt` is token ids, or a [tokens, hidden] tensor of embeddings. A sample's tokens after
        its first are held until `stream_interval` of them have come (or it ends)."""
        sent: dict[int, _Sent] = {}
        prompt_logprobs_sent = False
        outputs = self._outputs(request_id, prompt, params, cache_salt, priority, lora_request)
        async with aclosing(outputs):
            async for output in outputs:
                deltas = [
                    delta
                    for sample in output.outputs
                    if (
                        delta := _delta(
                            sample, sent.setdefault(sample.index, _Sent()), params, stream_interval
                        )
                    )
                ]
                if not deltas:  # a prompt chunk, or tokens held for the stream interval
                    continue
                for delta in deltas:
                    delta.num_cached_tokens = output.num_cached_tokens
                if output.prompt_logprobs is not None and deltas and not prompt_logprobs_sent:
                    prompt_logprobs_sent = True
                    for delta in deltas:
                        delta.prompt_logprobs = output.prompt_logprobs
                yield deltas

    async def embed(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> list[float]:
        """A pooling request's embedding."""
        outputs = self._outputs(request_id, prompt, params, cache_salt, priority, lora_request)
        async with aclosing(outputs):
            async for output in outputs:
                if output.finished:
                    return output.embedding
        raise RequestFailed(f"request {request_id} ended without its embedding")

    async def _outputs(
        self,
        request_id: str,
        prompt: list[int] | torch.Tensor,
        params: SamplingParams,
        cache_salt: str | None,
        priority: int,
        lora_request: LoRARequest | None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's cumulative outputs: RequestFailed for one the engine failed,
        EngineDeadError once the engine has stopped; leaving early aborts it."""
        stream = self.llm.generate(prompt, params, request_id, cache_salt, priority, lora_request)
        try:
            async for output in stream:
                if output.error is not None:
                    raise RequestFailed(output.error)
                yield output
        except EngineDead as error:
            raise _engine_dead(str(error)) from error
        finally:
            await stream.aclose()

    async def control(self, name: str, *args: object) -> object:
        """An operator's call between engine steps (LLMEngine.control): reset_prefix_cache
        (returns the entries forgotten), pause, resume, sleep, wake_up, state. Raises ValueError
        for bad arguments, RuntimeError for a call the engine's state refuses."""
        try:
            return await self.llm.control(name, *args)
        except EngineDead as error:
            raise _engine_dead(str(error)) from error

    def stats(self) -> EngineStats:
        return self.llm.stats()

    def replica_stats(self) -> list[EngineStats]:
        """One EngineStats per data-parallel replica (one in all for a single engine)."""
        if isinstance(self.llm, DataParallelLLM):
            return self.llm.replica_stats()
        return [self.llm.stats()]

    def shutdown(self) -> None:
        """Stop the engine; from now on the server answers 503."""
        self.llm.shutdown()


def _engine_dead(reason: str) -> EngineDeadError:
    return EngineDeadError(f"the engine has stopped: {reason}")


def _delta(
    sample: CompletionOutput, sent: _Sent, params: SamplingParams, interval: int = 1
) -> SampleDelta | None:
    """The part of a cumulative sample not sent yet, or None if nothing changed (or, after its
    first tokens, fewer than `interval` new ones came and it has not ended). A token's top
    logprobs are its k most likely, or the tokens logprob_token_ids lists, in their order."""
    newly_finished = sample.finish_reason is not None and not sent.finished
    if not newly_finished and sent.tokens and len(sample.token_ids) - sent.tokens < interval:
        return None
    text = sample.text[sent.chars :]
    token_ids = sample.token_ids[sent.tokens :]
    if not text and not token_ids and not newly_finished:
        return None
    logprobs = None
    if sample.logprobs is not None:
        listed = params.logprob_token_ids
        logprobs = [
            TokenLogprob(
                token_id,
                top[token_id],
                [(t, top[t]) for t in listed]
                if listed is not None
                else sorted(top.items(), key=lambda item: -item[1])[: params.logprobs],
            )
            for token_id, top in zip(token_ids, sample.logprobs[sent.tokens :], strict=True)
        ]
    sent.chars, sent.tokens, sent.finished = (
        len(sample.text),
        len(sample.token_ids),
        newly_finished or sent.finished,
    )
    if not newly_finished:
        return SampleDelta(sample.index, text, token_ids, logprobs, None)
    return SampleDelta(sample.index, text, token_ids, logprobs, sample.finish_reason, sample.stop_reason)
