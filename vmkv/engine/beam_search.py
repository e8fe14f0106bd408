"""Beam search inside the engine: each step keeps a request's n most likely continuations.

Each live beam offers its 2n most likely next tokens, by the model's log-probabilities (the
sampling controls, temperature included, do not enter). A candidate that ends the sequence
(end-of-sequence unless ignore_eos, or a stop token id) becomes a finished hypothesis; the n
best of the others, by cumulative log-probability, are the next beams. After max_tokens steps
the n best of all hypotheses, finished and live, by cumulative log-probability / length **
length_penalty (the length counts the prompt but not an ending token) are the answer. That is
vLLM's rule, and the answers are the same.

What differs is where it runs. vLLM drives its beams from the front door, each step a new
request per beam that re-reads the prefix cache. Here the beams are the request's sequences:
the beam one continuation extends keeps its sequence, each further continuation forks it
(the layout shares the KV: a block-table copy in paged mode, the same physical pages in
vattention) and a beam that no continuation extends is freed, so a step writes one token of
KV per beam and nothing is recomputed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vmkv.engine.sequence import FinishReason, Sequence


@dataclass(frozen=True)
class Candidate:
    beam: int  # position of the beam it extends among the request's live beams
    token: int
    logprob: float
    cumulative_logprob: float


@dataclass
class Hypothesis:
    """A finished or surviving beam: its generated tokens and how likely they are."""

    token_ids: list[int]
    cumulative_logprob: float
    logprobs: list[dict[int, float]] | None
    finish_reason: FinishReason
    stop_reason: int | None = None

    def score(self, prompt_len: int, length_penalty: float) -> float:
        length = prompt_len + len(self.token_ids) - (self.finish_reason is FinishReason.STOP)
        return self.cumulative_logprob / max(length, 1) ** length_penalty


@dataclass
class Proposals:
    """One step's candidates for a request's beams."""

    carried: list[Candidate]  # the next beams, best first
    ended: list[Candidate]  # those that finish a hypothesis
    top: list[tuple[list[int], list[float]]]  # per beam: its most likely tokens, log-probabilities

    def logprobs(self, candidate: Candidate, k: int) -> dict[int, float]:
        """The candidate's step as SamplingParams.logprobs reports it: top k plus its own token."""
        tokens, values = self.top[candidate.beam]
        return dict(zip(tokens[:k], values[:k], strict=True)) | {candidate.token: candidate.logprob}


@dataclass
class BeamSearch:
    """A request's search state beside its live beams (the group's sequences)."""

    width: int
    ends: Callable[[int], bool]  # whether a token finishes a hypothesis
    prompt_len: int
    length_penalty: float
    # the width best finished hypotheses: a finished one's score never changes, so one with
    # width better ones can never be in the answer
    finished: list[Hypothesis] = field(default_factory=list)

    def score(self, hypothesis: Hypothesis) -> float:
        return hypothesis.score(self.prompt_len, self.length_penalty)

    def finish(self, hypotheses: list[Hypothesis]) -> None:
        self.finished = sorted(self.finished + hypotheses, key=self.score, reverse=True)[: self.width]

    def propose(self, beams: list[Sequence], logprobs: torch.Tensor, num_logprobs: int) -> Proposals:
        """Each beam's 2 x width most likely tokens as candidates (`logprobs`: one
        log-softmax row per beam; `num_logprobs`: how many top tokens the request reports)."""
        offered = min(2 * self.width, logprobs.shape[-1])
        values, tokens = logprobs.topk(min(max(offered, num_logprobs), logprobs.shape[-1]), dim=-1)
        top = list(zip(tokens.tolist(), values.tolist(), strict=True))
        carried, ended = [], []
        for i, (row_tokens, row_values) in enumerate(top):
            for token, value in zip(row_tokens[:offered], row_values[:offered], strict=True):
                candidate = Candidate(i, token, value, beams[i].cumulative_logprob + value)
                (ended if self.ends(token) else carried).append(candidate)
        carried.sort(key=lambda c: -c.cumulative_logprob)  # stable: ties keep beam, then rank order
        return Proposals(carried[: self.width], ended, top)

    def best(self, beams: list[Sequence]) -> list[Hypothesis]:
        """The answer once the search is over: the width best of finished and live hypotheses
        (a stable sort: on equal scores the finished ones first, then the live in beam order)."""
        live = [
            Hypothesis(s.token_ids[s.prompt_len :], s.cumulative_logprob, s.logprobs, FinishReason.LENGTH)
            for s in beams
        ]
        return sorted(self.finished + live, key=self.score, reverse=True)[: self.width]
