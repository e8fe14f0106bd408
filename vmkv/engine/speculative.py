"""Speculative decoding by n-gram prompt lookup (vLLM's "ngram" method): no draft model.

A decoding sequence whose last few tokens occurred earlier in its prompt or output proposes
the tokens that followed them there as a draft. The step then computes the sequence's last
token and its draft together, as a short prefill chunk over its cached context, and the
model's logits at each of those positions verify the draft (the engine's verify step).

Verification samples each position as a plain decode step would, with the sampler's every
rule, and keeps a draft token while it equals the token sampled at its position. For a draft
that is one fixed token this is speculative sampling's acceptance rule exactly: the draft is
kept with probability p(draft), and when it is not, the token sampled is distributed as p
without the draft, the residual the rule samples from. So a request's tokens are distributed
as without speculation, and a greedy or seeded one gets the same tokens (each emitted token
takes one draw from its generator, as before) up to floating-point differences between
computing one position and several (none seen eager on the CPU, where a draft's attention
runs through the decode kernel one row per token: docs/engine.md).

On the CPU a step is bound by reading the weights at small batch: computing 1 + k positions
costs little more than 1 (docs/engine.md, "Speculative decoding"), so each accepted draft
token is a step saved.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

import numpy as np

METHODS = ("ngram",)
# vLLM's default n-gram length when neither prompt_lookup_min nor prompt_lookup_max is given
DEFAULT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config keys for the n-gram method.

    num_speculative_tokens: draft tokens per step at most; the last prompt_lookup_max down to
    prompt_lookup_min tokens are looked for earlier in the sequence, the longest match first.
    num_speculative_tokens_per_batch_size: vLLM's batch-size schedule, ((first, last, k), ...)
    inclusive ranges of running sequences, sorted, the first from 1; a size between or past the
    ranges takes the k of the range before it; k = 0 turns drafting off. None: the same k at
    every size. On a CPU a step's cost grows with its tokens once the batch is a few sequences
    (docs/engine.md, "Speculative decoding"), where drafts that are not accepted cost more than
    the steps they save.
    adaptive_length (vmkv's own key): cut each proposal to the tokens whose chance of being
    accepted pays for their compute at the step's batch size, both measured as the engine runs
    (draft_length.py); False verifies every proposed token, as vLLM does.
    """

    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    method: str = "ngram"
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None
    adaptive_length: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative method {self.method!r} is not supported; vmkv has {METHODS} (no draft model)"
            )
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative {name} must be a positive integer, got {value!r}")
        if not isinstance(self.adaptive_length, bool):
            raise ValueError(f"speculative adaptive_length must be a bool, got {self.adaptive_length!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.num_speculative_tokens_per_batch_size is not None:
            schedule = check_schedule(self.num_speculative_tokens_per_batch_size)
            object.__setattr__(self, "num_speculative_tokens_per_batch_size", schedule)

    def tokens_at(self, batch_size: int) -> int:
        """Draft tokens per sequence at most in a step of batch_size running sequences."""
        schedule = self.num_speculative_tokens_per_batch_size
        if schedule is None:
            return self.num_speculative_tokens
        tokens = 0
        for first, _, k in schedule:
            if first > batch_size:
                break
            tokens = k
        return min(tokens, self.num_speculative_tokens)

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, object] | str | None) -> SpeculativeConfig | None:
        """From vLLM's form: a dict or its JSON text, e.g. {"method": "ngram",
        "num_speculative_tokens": 4, "prompt_lookup_max": 4}; a lookup bound not given takes the
        other's value, both absent take vLLM's 5. Unknown keys are refused, not ignored."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative config is not JSON: {error}") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative config keys {unknown} are not supported; known: {sorted(known)}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative config needs num_speculative_tokens")
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if low is None and high is None:
            low = high = DEFAULT_LOOKUP
        return cls(
            num_speculative_tokens=value["num_speculative_tokens"],
            prompt_lookup_max=high if high is not None else low,
            prompt_lookup_min=low if low is not None else high,
            method=value.get("method", "ngram"),
            num_speculative_tokens_per_batch_size=value.get("num_speculative_tokens_per_batch_size"),
            adaptive_length=value.get("adaptive_length", True),
        )

    def as_dict(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def check_schedule(schedule: object) -> tuple[tuple[int, int, int], ...]:
    """num_speculative_tokens_per_batch_size as vLLM validates it, as a tuple of triples."""
    entries = list(schedule) if isinstance(schedule, list | tuple) else None
    if not entries or not all(
        isinstance(e, list | tuple)
        and len(e) == 3
        and all(isinstance(v, int) and not isinstance(v, bool) for v in e)
        for e in entries
    ):
        raise ValueError(
            "speculative num_speculative_tokens_per_batch_size must be a non-empty list of "
            f"[first, last, num_speculative_tokens] integer triples, got {schedule!r}"
        )
    triples = sorted((tuple(e) for e in entries), key=lambda e: e[0])
    previous = 0
    for first, last, k in triples:
        if not 0 < first <= last or k < 0 or first <= previous:
            raise ValueError(
                "speculative num_speculative_tokens_per_batch_size: ranges must be positive, "
                f"first <= last, not overlapping, with k >= 0; got {schedule!r}"
            )
        previous = last
    if triples[0][0] != 1:
        raise ValueError("speculative num_speculative_tokens_per_batch_size must start at batch size 1")
    return tuple(triples)


def propose_ngram(token_ids: Sequence[int], config: SpeculativeConfig, limit: int) -> list[int]:
    """Up to `limit` draft tokens (at most num_speculative_tokens): those that followed an earlier
    occurrence of the sequence's last n tokens, for the largest n from prompt_lookup_max down to
    prompt_lookup_min that occurs; [] when none does. Of several occurrences, the most recent
    one with that many tokens after it, else the most recent: in a repeating span the most
    recent occurrence is one period back and would propose only one period's tokens.

    Vectorised over the sequence (numpy): the earlier positions of the last token, then how far
    back each match reaches: ~30 µs at 2,000 tokens, most of it reading the list.
    """
    k = min(limit, config.num_speculative_tokens)
    if k < 1 or len(token_ids) <= config.prompt_lookup_min:
        return []
    tokens = np.fromiter(token_ids, dtype=np.int64, count=len(token_ids))
    last = len(tokens) - 1
    ends = np.flatnonzero(tokens[:last] == tokens[last])  # where an earlier occurrence ends
    matched = np.ones(len(ends), dtype=np.int64)  # tokens matched backwards from each end
    reaching = ends.copy()
    for back in range(1, config.prompt_lookup_max):
        reaching = reaching[reaching >= back]  # only ends still matching at every step
        if not len(reaching):
            break
        same = tokens[reaching - back] == tokens[last - back]
        reaching = reaching[same]
        matched[np.searchsorted(ends, reaching)] += 1
    if not len(ends) or matched.max() < config.prompt_lookup_min:
        return []
    hits = ends[matched == matched.max()]
    full = hits[hits + 1 + k <= len(tokens)]
    start = int(full[-1] if len(full) else hits[-1]) + 1
    return tokens[start : start + k].tolist()
