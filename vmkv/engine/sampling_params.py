"""Per-request sampling parameters, validated at construction so bad values never reach a step."""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Literal

from vmkv.engine.errors import RequestRejected
from vmkv.engine.repetition import RepetitionDetection

# The least temperature and repetition penalty above 0: float32's smallest normal number. The
# logits are float32, and a smaller scale rounded to 0 made NaNs of them (0 x -inf, 0 / 0).
SMALLEST_LOGIT_SCALE = 2.0**-126

StructuredKind = Literal["json", "json_object", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output text, compiled into a token mask by vmkv.engine.structured_output.

    kind json: `spec` is a JSON schema (as JSON text); json_object: any JSON object (`spec`
    empty); regex: a regular expression; choice: one of `choices` exactly; grammar: an EBNF
    grammar whose start rule is `root`.
    """

    kind: StructuredKind
    spec: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("json", "json_object", "regex", "choice", "grammar"):
            raise ValueError(
                f"structured kind must be json, json_object, regex, choice or grammar, got {self.kind!r}"
            )
        if self.kind == "choice" and (not self.choices or any(not isinstance(c, str) for c in self.choices)):
            raise ValueError("a structured choice needs at least one string")
        if self.kind in ("json", "regex", "grammar") and not self.spec:
            raise ValueError(f"structured output {self.kind} needs a non-empty spec")


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 is greedy. top_k 0 (or -1) and top_p 1 disable those filters. `seed` gives
    the request its own random stream, so the same seed gives the same output. n samples
    share the prompt's KV: the prompt is prefilled once, then forked. logprobs=k returns the
    k most likely tokens at each step (from the unmodified model distribution) plus the
    sampled one; logprob_token_ids, those tokens instead of the k most likely (scoring a fixed
    set of labels). prompt_logprobs=k does the same for every prompt token after the first
    (such a request never reads the prefix cache: a cached token has no logits). Stop strings
    are cut from the returned text (include_stop_str_in_output keeps the string that matched
    and cuts after it); stop token ids end the sample and stay in token_ids, as the
    end-of-sequence token does.

    The logits processors follow vLLM's definitions: repetition_penalty divides positive
    (multiplies negative) logits of tokens seen in the prompt or output; frequency_penalty
    subtracts penalty x count and presence_penalty subtracts penalty once, for tokens in
    the output; min_tokens masks end-of-sequence and stop token ids until that many tokens
    exist; min_p drops tokens below min_p x the top token's probability (after temperature);
    logit_bias adds its value to each listed token's logit; bad_words_token_ids bans the last
    token of each listed sequence wherever the output ends with the rest of it (the API
    tokenizes bad_words into these, as vLLM does); allowed_token_ids masks every token not
    listed; `structured` masks every token the constraint does not allow and ends the sample
    when the constraint is complete. end_of_thinking is a reasoning model's end-of-thinking
    token ids: with `structured`, the constraint holds only from the token after the output
    first ends with them (the thinking before is free); with thinking_budget, once that many
    tokens have been output before them, they are forced, one token a step. repetition_detection
    ends a sample whose output has fallen into a loop (finish reason "repetition"). extra_args
    are for the engine's custom logits processors (vmkv.engine.logits_processors), which read
    them to decide whether and how they apply.

    pooling makes the request an embedding of its prompt instead of a generation: the final
    hidden states of its last token ("last") or the mean of all its tokens' ("mean"), L2
    normalized, in RequestOutput.embedding; it finishes when its prompt is computed, sampling
    nothing (n must be 1; controls of the output do not apply).

    use_beam_search makes the n samples beams (vmkv.engine.beam_search): the n most likely
    continuations by the model's log-probabilities, ranked at the end by cumulative
    log-probability / length ** length_penalty. Temperature and seed do not change it; the
    controls that would (top_p, top_k, min_p, penalties, biases, bans, structured output, stop
    strings) are refused with it.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    allowed_token_ids: list[int] | None = None
    structured: StructuredOutput | None = None
    end_of_thinking: list[int] | None = None
    thinking_budget: int | None = None
    repetition_detection: RepetitionDetection | None = None
    pooling: Literal["last", "mean"] | None = None
    extra_args: dict[str, Any] | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        _check_int("n", self.n, minimum=1)
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("top_k", self.top_k, minimum=-1)
        if self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.temperature, int | float) or not 0.0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if 0.0 < self.temperature < SMALLEST_LOGIT_SCALE:
            raise ValueError(
                f"temperature must be 0 or at least {SMALLEST_LOGIT_SCALE:.3g} (float32's smallest normal "
                f"number: the logits are float32), got {self.temperature!r}"
            )
        if not isinstance(self.top_p, int | float) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0)
        self.logprob_token_ids = _token_ids("logprob_token_ids", self.logprob_token_ids)
        if self.logprob_token_ids is not None and self.logprobs is None:
            raise ValueError("logprob_token_ids needs logprobs set (the logprobs it replaces)")
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, minimum=0)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must hold non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must hold non-negative integers, got {self.stop_token_ids!r}")
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        if not _finite(self.repetition_penalty) or self.repetition_penalty < SMALLEST_LOGIT_SCALE:
            raise ValueError(
                f"repetition_penalty must be a finite number >= {SMALLEST_LOGIT_SCALE:.3g} (float32's "
                f"smallest normal number: the logits are float32), got {self.repetition_penalty!r}"
            )
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logit_bias is not None:
            self.logit_bias = dict(self.logit_bias)
            for token, bias in self.logit_bias.items():
                if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                    raise ValueError(f"logit_bias keys must be non-negative token ids, got {token!r}")
                _check_float("logit_bias", bias, -100.0, 100.0)
        self.bad_words_token_ids = [list(word) for word in self.bad_words_token_ids]
        if any(
            not word or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in word)
            for word in self.bad_words_token_ids
        ):
            raise ValueError("bad_words_token_ids must hold non-empty lists of non-negative token ids")
        self.allowed_token_ids = _token_ids("allowed_token_ids", self.allowed_token_ids)
        if self.extra_args is not None and (
            not isinstance(self.extra_args, dict) or not all(isinstance(k, str) for k in self.extra_args)
        ):
            raise ValueError(f"extra_args must be a dict with string keys, got {self.extra_args!r}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be a StructuredOutput, got {type(self.structured).__name__}")
        self.end_of_thinking = _token_ids("end_of_thinking", self.end_of_thinking)
        if self.thinking_budget is not None:
            _check_int("thinking_budget", self.thinking_budget, 0)
            if self.end_of_thinking is None:
                raise ValueError("thinking_budget needs end_of_thinking (the tokens it forces)")
        elif self.end_of_thinking is not None and self.structured is None:
            raise ValueError("end_of_thinking needs structured or thinking_budget set (what it ends)")
        if self.repetition_detection is not None and not isinstance(
            self.repetition_detection, RepetitionDetection
        ):
            raise ValueError(
                "repetition_detection must be a RepetitionDetection, got "
                f"{type(self.repetition_detection).__name__}"
            )
        if self.pooling is not None:
            self._check_pooling()
        if not isinstance(self.use_beam_search, bool):
            raise ValueError(f"use_beam_search must be a bool, got {self.use_beam_search!r}")
        if not _finite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if self.use_beam_search:
            self._check_beam_search()
        elif self.length_penalty != 1.0:
            raise ValueError("length_penalty applies to beam search only (set use_beam_search)")

    def _check_pooling(self) -> None:
        if self.pooling not in ("last", "mean"):
            raise ValueError(f"pooling must be 'last' or 'mean', got {self.pooling!r}")
        generating = {
            "n": self.n != 1,
            "use_beam_search": self.use_beam_search,
            "logprobs": self.logprobs is not None,
            "prompt_logprobs": self.prompt_logprobs is not None,
            "structured": self.structured is not None,
        }
        if taken := [name for name, used in generating.items() if used]:
            raise ValueError(f"pooling embeds the prompt and generates nothing: {taken[0]} does not apply")

    def _check_beam_search(self) -> None:
        """Refuse the controls beam search would ignore: it keeps the most likely continuations."""
        for f in fields(self):
            if f.name in BEAM_SEARCH_IGNORES:
                default = f.default_factory() if f.default is MISSING else f.default  # type: ignore[misc]
                if getattr(self, f.name) != default:  # a ValueError naming the field to change
                    raise RequestRejected(
                        f"{f.name} does not apply to beam search, which keeps the most likely "
                        "continuations by the model's log-probabilities",
                        f.name,
                    )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits (then the sampler needs the row's tokens)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def processes_logits(self) -> bool:
        """Whether the sampler must change this row's logits before picking; rows that do not
        stay on the plain path and cost nothing extra (min_p is a filter of the draw, like top-p,
        and never changes the argmax)."""
        return (
            self.penalized
            or self.min_tokens > 0
            or bool(self.logit_bias)
            or bool(self.bad_words_token_ids)
            or self.allowed_token_ids is not None
            or self.structured is not None
            or self.thinking_budget is not None
        )


# sampling controls beam search has no use for: set with use_beam_search, they are refused
BEAM_SEARCH_IGNORES = frozenset(
    {
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_tokens",
        "logit_bias",
        "bad_words_token_ids",
        "allowed_token_ids",
        "structured",
        "thinking_budget",
        "repetition_detection",
        "extra_args",
        "stop",
        "logprob_token_ids",
    }
)


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_float(name: str, value: object, low: float, high: float) -> None:
    if not _finite(value) or not low <= value <= high:
        raise ValueError(f"{name} must be a number in [{low}, {high}], got {value!r}")


def _token_ids(name: str, value: object) -> list[int] | None:
    """An optional non-empty list of token ids, as a list; ValueError naming `name` otherwise."""
    if value is None:
        return None
    ids = list(value) if isinstance(value, list | tuple) else []
    if not ids or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
        raise ValueError(f"{name} must be a non-empty list of non-negative token ids, got {value!r}")
    return ids


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
