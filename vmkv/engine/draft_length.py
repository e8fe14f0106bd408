"""How many draft tokens a sample verifies this step: those worth their compute.

A draft token costs the compute of one more token in the step whether or not it is accepted,
and saves a share of a step when it is. At batch 1 on a CPU a step is bound by reading the
weights and a token more costs little, so every proposed token pays; at 16 sequences a token
costs nearly what any other does (docs/engine.md, "Speculative decoding"), and a draft that is
accepted half the time loses. So the length follows the two numbers that decide it, both
measured as the engine runs, the goodput idea of SmartSpec (Liu et al., 2024, "Optimizing
Speculative Decoding for Serving Large Language Models Using Goodput"), decided per token:

- the price: a decode step's seconds as a least-squares line a + b * tokens over recent
  steps. A draft token pays when its chance of being accepted per second it costs (b) beats
  the tokens per second the engine gets (the first-order condition of the most tokens per
  second), estimated at the step's batch B from the line and recent steps' mean tokens
  emitted and computed per sequence: B * emitted / (a + b * B * computed). Without drafts the
  bar is b * B / (a + b * B);
- the chance: token j of a draft is kept when the j - 1 before it were and it matches,
  estimated as alpha ** j, alpha the sample's recent rate of kept tokens among those verified,
  weighted toward the engine's own recent rate (so a new request of a workload that repeats
  its context drafts at once); then scaled by the engine's recent ratio of tokens kept to
  tokens so estimated. That calibration matters: samples draft right after their drafts did
  well, and success does not last as long as the rate assumes (at 64 sequences on the code
  edit a token needed a chance of ~0.77 to pay, and the drafted ones were kept 0.65 of the
  time).

A sample refused a draft fades its own evidence toward the engine's rate, so one that starts
repeating its context after failed drafts tries again within a few steps; and a step that
refused any fades the engine's toward certainty, so drafts that nobody verifies (a workload
that changed) are tried again within tens of steps, not never.
"""

from __future__ import annotations

from dataclasses import dataclass

# memory of the step line, in steps: the batch and context change over a run
STEP_DECAY = 0.98
# the least spread of tokens (standard deviation) over the remembered steps that fits a line
MIN_TOKEN_SPREAD = 1.0
# memory of a sample's own drafts (~5) and of the engine's (~50), per verified draft
SAMPLE_DECAY = 0.8
ENGINE_DECAY = 0.98
# a refused proposal halves the sample's evidence (tried again within a few steps), a step with
# one fades the engine's (tried again within ~30 steps when the engine's rate was poor)
REFUSED_DECAY = 0.5
REFUSED_ENGINE_DECAY = 0.9
# the engine's rate counts as this many verified tokens of a sample's own evidence
PRIOR_WEIGHT = 2.0
# the calibration starts at 1 as if this many tokens had been kept as estimated
CALIBRATION_WEIGHT = 4.0


@dataclass
class DraftRecord:
    """A sample's recent draft tokens kept and rejected (decayed counts): its acceptance."""

    kept: float = 0.0
    rejected: float = 0.0
    alpha: float = 1.0  # the rate its draft awaiting verification was cut by

    def add(self, kept: int, rejected: int, decay: float) -> None:
        self.kept = self.kept * decay + kept
        self.rejected = self.rejected * decay + rejected

    def rate(self, prior: float, weight: float) -> float:
        return (self.kept + prior * weight) / (self.kept + self.rejected + weight)


class StepCost:
    """A decode step's seconds as a + b * tokens, fitted by least squares over recent steps, and
    the tokens a sequence computes and gains in a step (decayed alike)."""

    def __init__(self) -> None:
        self._n = self._x = self._y = self._xx = self._xy = 0.0
        self._seqs = self._emitted = 0.0
        self.line: tuple[float, float] | None = None  # (a, b) seconds; None until tokens varied

    def observe(self, sequences: int, tokens: int, emitted: int, seconds: float) -> None:
        """A decode step of `sequences` that computed `tokens` (their drafts too) and emitted
        `emitted` tokens in `seconds`."""
        d = STEP_DECAY
        self._n = self._n * d + 1
        self._x = self._x * d + tokens
        self._y = self._y * d + seconds
        self._xx = self._xx * d + tokens * tokens
        self._xy = self._xy * d + tokens * seconds
        self._seqs = self._seqs * d + sequences
        self._emitted = self._emitted * d + emitted
        spread = self._n * self._xx - self._x * self._x  # n^2 * variance of tokens
        if spread >= (self._n * MIN_TOKEN_SPREAD) ** 2:
            b = max(0.0, (self._n * self._xy - self._x * self._y) / spread)
            a = max(0.0, (self._y - b * self._x) / self._n)
            self.line = (a, b)  # a batch the line cannot tell apart keeps the last line

    def threshold(self, batch: int) -> float:
        """The least chance of acceptance that pays for a draft token at this batch size: its
        cost b times the engine's tokens per second there."""
        if self.line is None:
            return 0.0
        a, b = self.line
        emitted, computed = self._emitted / self._seqs, self._x / self._seqs
        step = a + b * batch * computed
        return b * batch * emitted / step if step > 0 else 0.0


class DraftLength:
    """Bounds each sample's draft to the tokens whose chance of being kept pays for them."""

    def __init__(self) -> None:
        self.cost = StepCost()
        self.engine = DraftRecord()
        self._expected = 0.0  # tokens recent drafts were estimated to keep (engine.kept: kept)
        self.threshold = 0.0  # this step's least chance of acceptance that pays
        self._refused = False  # whether this step refused a proposal

    @property
    def calibration(self) -> float:
        return (self.engine.kept + CALIBRATION_WEIGHT) / (self._expected + CALIBRATION_WEIGHT)

    def start_step(self, batch: int) -> None:
        if self._refused:
            self.engine.add(0, 0, REFUSED_ENGINE_DECAY)
            self._expected *= REFUSED_ENGINE_DECAY
        self._refused = False
        self.threshold = self.cost.threshold(batch)

    def allowed(self, record: DraftRecord, most: int) -> int:
        """How many draft tokens, `most` at most, the sample may verify this step. Asked before
        the n-gram lookup, which a sample refused skips (~30 µs a sample at 2,000 tokens)."""
        record.alpha = record.rate(self.engine.rate(1.0, 1.0), PRIOR_WEIGHT)
        chance, length, calibration = 1.0, 0, self.calibration
        while length < most:
            chance *= record.alpha
            if chance * calibration < self.threshold:
                break
            length += 1
        if length == 0 and most:
            record.add(0, 0, REFUSED_DECAY)  # refused: its own evidence fades toward the engine's
            self._refused = True
        return length

    def verified(self, record: DraftRecord, drafted: int, kept: int) -> None:
        """A draft was verified: `kept` of its `drafted` tokens matched. A token after the first
        rejected one was never tried, so it is no evidence."""
        rejected = 1 if kept < drafted else 0
        record.add(kept, rejected, SAMPLE_DECAY)
        self.engine.add(kept, rejected, ENGINE_DECAY)
        self._expected = self._expected * ENGINE_DECAY + sum(record.alpha**j for j in range(1, drafted + 1))
