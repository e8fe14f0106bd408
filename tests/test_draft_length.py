"""The adaptive draft length: a proposal is cut to the tokens whose chance of acceptance pays for
their compute at the step's batch size, both measured as the engine runs (draft_length.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vmkv.engine.draft_length import DraftLength, DraftRecord, StepCost
from vmkv.engine.speculative import SpeculativeConfig


@given(
    a=st.floats(1e-3, 0.1),
    b=st.floats(0.0, 5e-3),
    tokens=st.lists(st.integers(1, 100).map(lambda n: 2 * n), min_size=3, max_size=60, unique=True),
)
def test_the_step_cost_is_the_line_its_steps_follow(a: float, b: float, tokens: list[int]) -> None:
    cost = StepCost()
    for n in tokens:  # steps of n sequences without drafts
        cost.observe(n, n, n, a + b * n)
    fitted_a, fitted_b = cost.line
    assert fitted_a == pytest.approx(a, rel=1e-6, abs=1e-9)
    assert fitted_b == pytest.approx(b, rel=1e-6, abs=1e-9)
    for batch in (1, 16):
        assert cost.threshold(batch) == pytest.approx(b * batch / (a + b * batch), abs=1e-6)


def test_drafts_that_pay_raise_the_bar_for_the_next_ones() -> None:
    """With drafts a step yields more tokens per second, and a draft token must beat that rate:
    at batch B, b * B * emitted / (a + b * B * computed), per sequence and step."""
    a, b = 0.010, 0.001
    plain, drafting = StepCost(), StepCost()
    for sequences in (4, 8, 16, 8):
        plain.observe(sequences, sequences, sequences, a + b * sequences)
        drafting.observe(sequences, 3 * sequences, 2 * sequences, a + b * 3 * sequences)
    assert plain.threshold(16) == pytest.approx(0.016 / 0.026)
    assert drafting.threshold(16) == pytest.approx(0.032 / 0.058)
    # compute-bound: a draft token pays when it is as likely as the tokens computed are to be kept
    assert drafting.threshold(10**6) == pytest.approx(2 / 3, rel=1e-3)


def test_steps_of_one_size_say_nothing_of_a_tokens_cost_so_every_draft_token_is_tried() -> None:
    cost = StepCost()
    for _ in range(50):
        cost.observe(16, 16, 16, 0.03)
    assert cost.line is None
    assert cost.threshold(16) == 0.0
    cost.observe(16, 32, 20, 0.05)  # now a line; steps of one size after it keep it
    line = cost.line
    for _ in range(500):
        cost.observe(16, 16, 16, 0.03)
    assert cost.line == pytest.approx(line)


@given(
    kept=st.integers(0, 30),
    rejected=st.integers(0, 30),
    threshold=st.floats(0.0, 1.0),
    proposed=st.integers(1, 8),
)
def test_a_draft_keeps_the_tokens_whose_chance_of_acceptance_reaches_the_threshold(
    kept: int, rejected: int, threshold: float, proposed: int
) -> None:
    policy = DraftLength()
    policy.threshold = threshold
    record = DraftRecord(float(kept), float(rejected))
    alpha = record.rate(policy.engine.rate(1.0, 1.0), 2.0)
    expected = next((j for j in range(proposed) if alpha ** (j + 1) < threshold), proposed)
    assert policy.allowed(record, proposed) == expected


def propose(policy: DraftLength, record: DraftRecord, kept: int) -> int:
    """A proposal of 4 tokens cut by the policy and verified, `kept` of them kept at most."""
    drafted = policy.allowed(record, 4)
    if drafted:
        policy.verified(record, drafted, min(kept, drafted))
    return drafted


def test_a_new_sample_starts_from_the_engines_rate() -> None:
    policy = DraftLength()
    policy.threshold = 0.5
    assert propose(policy, DraftRecord(), 4) == 4  # nothing seen yet: draft
    for _ in range(40):
        propose(policy, DraftRecord(), 0)  # the engine's drafts fail
    assert policy.allowed(DraftRecord(), 4) == 0


def test_a_sample_refused_for_its_own_failures_tries_again_within_a_few_steps() -> None:
    policy, good, poor = DraftLength(), DraftRecord(), DraftRecord()
    policy.threshold = 0.5
    for _ in range(5):
        propose(policy, good, 4)
        propose(policy, poor, 0)
    refusals = 0
    while policy.allowed(poor, 4) == 0:
        propose(policy, good, 4)  # others' drafts keep the engine's rate high
        refusals += 1
        assert refusals < 10
    assert refusals > 0


def test_drafts_kept_less_often_than_estimated_are_cut_shorter() -> None:
    """Calibration: the tokens kept over those the rates estimated scales every estimate."""
    policy, record = DraftLength(), DraftRecord(kept=20.0)
    policy.threshold = 0.5
    assert policy.allowed(record, 4) == 4
    lengths = []
    for _ in range(100):
        lengths.append(policy.allowed(record, 4))
        policy.verified(record, lengths[-1], min(1, lengths[-1]))  # one token kept at most
        record.kept, record.rejected = 20.0, 0.0  # the sample's own rate stays high
    assert 0.3 < policy.calibration < 0.8
    assert sum(lengths[50:]) / 50 < 2.5


def test_rejected_tokens_after_the_first_are_no_evidence() -> None:
    policy, record = DraftLength(), DraftRecord()
    policy.verified(record, 4, 2)
    assert (record.kept, record.rejected) == (2, 1)
    policy.verified(record, 3, 3)
    assert record.kept == pytest.approx(2 * 0.8 + 3) and record.rejected == pytest.approx(0.8)


def test_adaptive_length_is_on_by_default_and_reads_as_a_bool() -> None:
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2}).adaptive_length is True
    assert (
        SpeculativeConfig.parse({"num_speculative_tokens": 2, "adaptive_length": False}).adaptive_length
        is False
    )
    with pytest.raises(ValueError, match="adaptive_length must be a bool"):
        SpeculativeConfig.parse({"num_speculative_tokens": 2, "adaptive_length": "yes"})


def test_when_every_proposal_is_refused_the_engine_tries_drafts_again_within_tens_of_steps() -> None:
    policy = DraftLength()
    for _ in range(40):
        policy.verified(DraftRecord(), 4, 0)  # the engine's drafts failed; then nobody drafts
    policy.threshold = 0.5
    steps = 0
    while policy.allowed(DraftRecord(), 4) == 0:
        policy.start_step(16)
        policy.threshold = 0.5
        steps += 1
        assert steps < 100
    assert steps > 10
