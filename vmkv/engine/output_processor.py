"""Turns the engine process's token-id updates into a request's cumulative output, in the API process.

Detokenization and stop strings live here, beside the HTTP code, so the engine process
spends no time on text. A stop string ends its sample here at once (the stream sees
finish_reason stop with the text cut), and the engine is told to stop it; tokens the engine
produced for it meanwhile are dropped, as the engine's own stop-string check would have.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from vmkv.engine.detokenizer import IncrementalDetokenizer
from vmkv.engine.ipc import RequestUpdate, SampleUpdate
from vmkv.engine.outputs import CompletionOutput, PromptLogprob, RequestMetrics, RequestOutput
from vmkv.engine.prompt_embeds import text_context
from vmkv.engine.sampling_params import SamplingParams
from vmkv.engine.sequence import FinishReason
from vmkv.engine.stop_strings import cut_at_stop, find_stop, stop_hold, visible_text


@dataclass
class SampleState:
    detokenizer: IncrementalDetokenizer
    token_ids: list[int]  # prompt + output, as the detokenizer reads them
    prompt_len: int
    text: str = ""
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None  # the engine's figure
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def output(self, index: int, hold: int) -> CompletionOutput:
        return CompletionOutput(
            index=index,
            text=visible_text(self.text, self.finish_reason is not None, hold),
            token_ids=self.token_ids[self.prompt_len :],
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else list(self.logprobs),
        )


@dataclass
class RequestState:
    """One request as the API process sees it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    tokenizer: PreTrainedTokenizerBase
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=time.monotonic()))
    samples: dict[int, SampleState] = field(default_factory=dict)
    finished: bool = False
    error: str | None = None
    prompt_logprobs: list[PromptLogprob | None] | None = None
    num_cached_tokens: int = 0
    embedded: bool = False  # the prompt came as embeddings: its token ids are placeholders
    embedding: list[float] | None = None  # a pooling request's answer

    def apply(self, update: RequestUpdate) -> list[int]:
        """Take in one engine update; returns the indices of samples that met a stop string now."""
        stopped = []
        for sample_update in update.samples:
            sample = self.samples.get(sample_update.index) or self._new_sample(sample_update.index)
            if sample.finish_reason is None and self._extend(sample, sample_update):
                stopped.append(sample_update.index)
        if update.error is not None:
            self.error = update.error
        if update.prompt_logprobs is not None:
            self.prompt_logprobs = update.prompt_logprobs
        self.num_cached_tokens = update.num_cached_tokens
        self.embedding = update.embedding or self.embedding
        if self.metrics.first_token_time is None and any(u.new_token_ids for u in update.samples):
            self.metrics.first_token_time = time.monotonic()
        done = len(self.samples) == self.params.n and all(s.finish_reason for s in self.samples.values())
        if update.finished or done:
            self.finished = True
            self.metrics.finished_time = time.monotonic()
        return stopped

    def output(self) -> RequestOutput:
        hold = stop_hold(self.params.stop)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[sample.output(index, hold) for index, sample in sorted(self.samples.items())],
            finished=self.finished,
            metrics=self.metrics,
            error=self.error,
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
            embedding=self.embedding,
        )

    def _new_sample(self, index: int) -> SampleState:
        params = self.params
        sample = SampleState(
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, text_context(self.prompt_token_ids, self.embedded), params.skip_special_tokens
            ),
            token_ids=list(self.prompt_token_ids),
            prompt_len=len(self.prompt_token_ids),
            logprobs=None if params.logprobs is None else [],
        )
        self.samples[index] = sample
        return sample

    def _extend(self, sample: SampleState, update: SampleUpdate) -> bool:
        """Append the sample's new tokens and text; True if a stop string ended it here."""
        sample.token_ids += update.new_token_ids
        if update.new_logprobs is not None and sample.logprobs is not None:
            sample.logprobs += update.new_logprobs
        sample.cumulative_logprob = update.cumulative_logprob
        sample.finish_reason, sample.stop_reason = update.finish_reason, update.stop_reason
        delta = sample.detokenizer.step(sample.token_ids, final=update.finish_reason is not None)
        sample.text += delta
        checks = (
            delta and self.params.stop and len(sample.token_ids) - sample.prompt_len >= self.params.min_tokens
        )
        stop = find_stop(sample.text, self.params.stop, len(delta)) if checks else None
        if stop is None:
            return False
        at, sample.stop_reason = stop
        sample.text = cut_at_stop(sample.text, at, stop[1], self.params.include_stop_str_in_output)
        stopped_here = sample.finish_reason is None
        sample.finish_reason = str(FinishReason.STOP)
        return stopped_here
