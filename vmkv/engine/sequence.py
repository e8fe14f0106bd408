"""A request (SequenceGroup) and its samples (Sequence): tokens, cache progress, status.

A group is the unit of scheduling and preemption: its n samples share the prompt's KV
through forks, so they run, wait, swap and resume together.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from vmkv.engine.detokenizer import IncrementalDetokenizer
from vmkv.engine.draft_length import DraftRecord
from vmkv.engine.outputs import CompletionOutput, PromptLogprob, RequestMetrics, RequestOutput
from vmkv.engine.sampling_params import SamplingParams
from vmkv.engine.stop_strings import stop_hold, visible_text
from vmkv.engine.structured_output import GrammarState

if TYPE_CHECKING:
    from vmkv.engine.beam_search import BeamSearch
    from vmkv.engine.lora import LoRAAdapter


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # never scheduled
    RUNNING = "running"
    PREEMPTED = "preempted"  # KV dropped; waits to recompute prompt + generated tokens
    SWAPPED = "swapped"  # KV in host memory; waits to swap back in
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # end-of-sequence, stop token id or stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # the caller gave up on it
    ERROR = "error"  # the engine could not run it
    REPETITION = "repetition"  # its output fell into a loop (SamplingParams.repetition_detection)


@dataclass(eq=False)
class Sequence:
    """One sample: prompt + generated tokens and how far the KV cache has them.

    num_computed tokens have KV written; the cache has room for num_allocated (0: the
    sequence holds nothing in the cache). A fresh fork child has fork_parent set until the
    scheduler copies the parent's KV into it.
    """

    seq_id: int
    index: int
    token_ids: list[int]
    prompt_len: int
    detokenizer: IncrementalDetokenizer | None  # None: the engine's caller detokenizes
    generator: torch.Generator | None
    num_computed: int = 0
    num_allocated: int = 0
    fork_parent: Sequence | None = None
    text: str = ""
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    grammar: GrammarState | None = None  # its structured-output matcher (the sampler advances it)
    # True until the output ends with params.end_of_thinking: no constraint holds before it
    thinking: bool = False
    prompt_embeds: torch.Tensor | None = None  # its request's, fed for the prompt's positions
    lora: LoRAAdapter | None = None  # its request's adapter
    drafts: DraftRecord = field(default_factory=DraftRecord)  # its speculative drafts' acceptance

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    def reset_cache_state(self) -> None:
        """Forget the KV (it was freed): the next admission recomputes every token."""
        self.num_computed = 0
        self.num_allocated = 0
        self.fork_parent = None


@dataclass(eq=False)
class SequenceGroup:
    """A request: its prompt, parameters and n samples (one until the prompt is prefilled)."""

    request_id: str
    arrival: int  # admission order: scheduling and preemption compare (priority, arrival)
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    # Prefix-cache identity: only requests with equal salts share cached KV (paged layout).
    cache_salt: str | None = None
    priority: int = 0  # lower runs first under the priority policy; always 0 under fcfs
    status: RequestStatus = RequestStatus.WAITING
    error: str | None = None
    alone_failures: int = 0  # steps in a row it got no KV memory with nothing else holding any
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    # filled as prefill chunks compute (kept across a recompute preemption); None: not asked for
    prompt_logprobs: list[PromptLogprob | None] | None = None
    beam: BeamSearch | None = None  # with use_beam_search: the seqs are its live beams
    # a finished beam search's answer (the engine writes it; the beams are gone by then)
    beam_results: list[CompletionOutput] | None = None
    # a prompt given as [prompt, hidden] embeddings; prompt_token_ids are then placeholders
    prompt_embeds: torch.Tensor | None = None
    # with params.pooling: the final hidden states summed so far (mean) or the last row (last),
    # over the first `pooled_tokens` prompt tokens; then the finished embedding
    pooled: torch.Tensor | None = None
    pooled_tokens: int = 0
    embedding: list[float] | None = None
    lora: LoRAAdapter | None = None  # the adapter its samples run with (None: the base model)
    stop_hold: int = field(init=False)

    def __post_init__(self) -> None:
        self.stop_hold = stop_hold(self.params.stop)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def prompt_logprobs_done(self) -> bool:
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) == len(self.prompt_token_ids)

    @property
    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.finished]

    @property
    def num_seq_slots(self) -> int:
        """Samples this group may run at once: n minus those already finished."""
        return self.params.n - sum(s.finished for s in self.seqs)

    @property
    def is_prefilling(self) -> bool:
        return any(s.num_uncomputed > 1 for s in self.live_seqs)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def output(self) -> RequestOutput:
        outputs = self.beam_results or [
            CompletionOutput(
                index=s.index,
                text=visible_text(s.text, s.finished, self.stop_hold),
                token_ids=s.token_ids[s.prompt_len :],
                finish_reason=None if s.finish_reason is None else str(s.finish_reason),
                stop_reason=s.stop_reason,
                cumulative_logprob=None if s.logprobs is None else s.cumulative_logprob,
                logprobs=None if s.logprobs is None else list(s.logprobs),
            )
            for s in self.seqs
        ]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            metrics=self.metrics,
            error=self.error,
            prompt_logprobs=self.prompt_logprobs if self.prompt_logprobs_done else None,
            num_cached_tokens=self.num_cached_tokens,
            embedding=self.embedding,
        )
