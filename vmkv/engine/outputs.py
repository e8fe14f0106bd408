"""What the engine hands back: one RequestOutput per request per step it advanced."""

from __future__ import annotations

from dataclasses import dataclass, field

# A prompt token's top-k {token id: log-probability} (the token itself included) and the
# token's rank in the model's distribution (1 = most likely).
PromptLogprob = tuple[dict[int, float], int]


@dataclass
class RequestMetrics:
    """time.monotonic() stamps of a request's life, for latency metrics (None until reached)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class CompletionOutput:
    """One of the request's n samples, cumulative so far.

    logprobs[i] maps token id -> log-probability at output position i: the top-k requested
    plus the sampled token. finish_reason is None while running, else stop/length/abort/error;
    stop_reason is the stop string or stop token id that ended it, if any.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(repr=False, default=None)  # type: ignore[assignment]
    error: str | None = None  # why the request ended with finish_reason "error"
    # with SamplingParams.prompt_logprobs, once the prompt is computed: one entry per prompt
    # token, None for the first (nothing predicts it)
    prompt_logprobs: list[PromptLogprob | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache already held (not computed)
    embedding: list[float] | None = None  # with SamplingParams.pooling, once the prompt is computed
