"""Benchmark workloads: what each request asks for (prompt token ids, output length, n) and when it arrives.

Every workload is a pure function of its arguments and a seed, so the A and B sides of
a comparison, and two runs a week apart, see the same requests. Prompts are random token
ids from the model's ordinary (non-special) vocabulary and requests ask for exactly
`max_tokens` (served with ignore_eos), so output lengths are the workload's, not the model's.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class BenchRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int
    arrival: float = 0.0  # seconds after the run starts
    n: int = 1  # parallel samples sharing the prompt

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True)
class Workload:
    name: str
    requests: tuple[BenchRequest, ...]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.max_tokens * r.n for r in self.requests)

    @property
    def max_seq_len(self) -> int:
        return max(r.prompt_len + r.max_tokens for r in self.requests)

    def with_arrivals(self, times: Sequence[float], label: str) -> Workload:
        if len(times) != len(self.requests):
            raise ValueError(f"{len(times)} arrival times for {len(self.requests)} requests")
        requests = tuple(replace(r, arrival=float(t)) for r, t in zip(self.requests, times, strict=True))
        return Workload(f"{self.name}@{label}", requests)


@dataclass(frozen=True)
class TokenRange:
    """Token ids prompts are drawn from: [low, high), i.e. past the special tokens."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.high:
            raise ValueError(f"token range [{self.low}, {self.high}) is empty")

    def sample(self, rng: np.random.Generator, length: int) -> tuple[int, ...]:
        return tuple(int(t) for t in rng.integers(self.low, self.high, size=length))


@dataclass(frozen=True)
class Lognormal:
    """A long-tailed length distribution given by its median, clipped to [low, high]."""

    median: float
    sigma: float
    low: int
    high: int

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        values = np.rint(rng.lognormal(math.log(self.median), self.sigma, size=size))
        return np.clip(values, self.low, self.high).astype(np.int64)


@dataclass(frozen=True)
class WorkloadSpec:
    """What a workload generator needs besides its own shape.

    max_prompt / max_output clip the drawn lengths, so that a long-tailed workload fits a
    small machine's time budget; the clipping is part of the workload's definition.
    """

    num_requests: int
    tokens: TokenRange
    max_model_len: int
    seed: int = 0
    max_prompt: int | None = None
    max_output: int | None = None

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.max_model_len < 16:
            raise ValueError(f"max_model_len must be >= 16 for these workloads, got {self.max_model_len}")
        for name in ("max_prompt", "max_output"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

    def rng(self, salt: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, salt])


def _fit(prompt_len: int, max_tokens: int, max_model_len: int) -> tuple[int, int]:
    """Clip a (prompt, output) pair so it fits max_model_len, keeping at least one token of each."""
    max_tokens = max(1, min(max_tokens, max_model_len - 1))
    prompt_len = max(1, min(prompt_len, max_model_len - max_tokens))
    return prompt_len, max_tokens


def _from_lengths(
    name: str,
    spec: WorkloadSpec,
    prompts: np.ndarray,
    outputs: np.ndarray,
    n: int = 1,
    prefix: tuple[int, ...] = (),
) -> Workload:
    rng = spec.rng(1)
    requests = []
    for p, o in zip(prompts.tolist(), outputs.tolist(), strict=True):
        p, o = len(prefix) + p, o
        p, o = min(p, spec.max_prompt or p), min(o, spec.max_output or o)
        p, o = _fit(p, o, spec.max_model_len)
        own = spec.tokens.sample(rng, p - len(prefix)) if p > len(prefix) else ()
        requests.append(BenchRequest((prefix + own)[:p], o, n=n))
    return Workload(name, tuple(requests))


def chat(spec: WorkloadSpec) -> Workload:
    """Short prompts, long-tailed answers (median 64 / 96 tokens)."""
    rng = spec.rng(0)
    prompts = Lognormal(64, 0.7, 4, spec.max_model_len // 2).sample(rng, spec.num_requests)
    outputs = Lognormal(96, 0.8, 4, spec.max_model_len // 2).sample(rng, spec.num_requests)
    return _from_lengths("chat", spec, prompts, outputs)


def document(spec: WorkloadSpec) -> Workload:
    """Long prompts, short answers (median 768 / 24 tokens): prefill-bound."""
    rng = spec.rng(0)
    prompts = Lognormal(768, 0.4, 64, spec.max_model_len - 8).sample(rng, spec.num_requests)
    outputs = Lognormal(24, 0.5, 4, 128).sample(rng, spec.num_requests)
    return _from_lengths("document", spec, prompts, outputs)


def fixed(
    spec: WorkloadSpec, prompt_len: int = 256, output_len: int = 128, range_ratio: float = 1.0
) -> Workload:
    """Uniform random lengths in [range_ratio * L, L]; range_ratio 1 gives exactly L (the common
    'random' dataset of serving benchmarks)."""
    if not 0.0 < range_ratio <= 1.0:
        raise ValueError(f"range_ratio must be in (0, 1], got {range_ratio}")
    rng = spec.rng(0)
    prompts = rng.integers(math.ceil(range_ratio * prompt_len), prompt_len + 1, size=spec.num_requests)
    outputs = rng.integers(math.ceil(range_ratio * output_len), output_len + 1, size=spec.num_requests)
    return _from_lengths(f"fixed-{prompt_len}-{output_len}", spec, prompts, outputs)


def shared_prefix(spec: WorkloadSpec, system_len: int = 512) -> Workload:
    """One long system prompt shared by every user, then a short question each: prefix caching's case."""
    system_len = min(system_len, spec.max_model_len // 2)
    rng = spec.rng(0)
    system = spec.tokens.sample(spec.rng(2), system_len)
    questions = Lognormal(32, 0.5, 4, 128).sample(rng, spec.num_requests)
    outputs = Lognormal(64, 0.5, 4, 256).sample(rng, spec.num_requests)
    return _from_lengths("shared-prefix", spec, questions, outputs, prefix=system)


def parallel(spec: WorkloadSpec, n: int = 4) -> Workload:
    """Chat-like prompts with n parallel samples each: forked sequences share the prompt's KV."""
    base = chat(spec)
    return Workload(f"parallel-n{n}", tuple(replace(r, n=n) for r in base.requests))


def long_context(spec: WorkloadSpec, output_len: int = 32) -> Workload:
    """Prompts filling most of max_model_len: attention over long contexts dominates."""
    rng = spec.rng(0)
    top = spec.max_model_len - output_len
    prompts = rng.integers(max(1, top * 3 // 4), top + 1, size=spec.num_requests)
    outputs = np.full(spec.num_requests, output_len)
    return _from_lengths("long-context", spec, prompts, outputs)


WORKLOADS: dict[str, Callable[[WorkloadSpec], Workload]] = {
    "chat": chat,
    "document": document,
    "fixed": fixed,
    "shared-prefix": shared_prefix,
    "parallel": parallel,
    "long-context": long_context,
}


def make_workload(name: str, spec: WorkloadSpec) -> Workload:
    try:
        return WORKLOADS[name](spec)
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(WORKLOADS)}") from None


# ------------------------------------------------------------------ arrivals
def arrival_times(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Send times in seconds: all at once (rate inf), else gamma-distributed gaps of mean 1/rate.

    burstiness is the gamma shape: 1 is a Poisson process, below 1 burstier, above 1 steadier.
    The first request goes at time 0, as serving benchmarks do.
    """
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    if not rate > 0:
        raise ValueError(f"rate must be positive (or inf), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if math.isinf(rate):
        return np.zeros(num)
    gaps = np.random.default_rng([seed, 7]).gamma(burstiness, 1.0 / (rate * burstiness), size=num)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])[:num]


def parse_rates(text: str) -> list[float]:
    """'1,2,4,inf' -> [1.0, 2.0, 4.0, inf] (requests per second)."""
    rates = []
    for part in text.split(","):
        part = part.strip()
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(f"a rate is a number or 'inf', got {part!r}") from None
        if not rate > 0:
            raise ValueError(f"rates must be positive, got {part!r}")
        rates.append(rate)
    if not rates:
        raise ValueError("no rates given")
    return rates


def rate_label(rate: float) -> str:
    """Three significant digits: a trace's measured mean rate is not a round number."""
    return "inf" if math.isinf(rate) else f"{rate:.3g}"


# --------------------------------------------------------------------- traces
@dataclass(frozen=True)
class TraceRow:
    timestamp: float  # seconds (any origin)
    context_tokens: int
    generated_tokens: int


TRACE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def _parse_timestamp(text: str) -> float:
    """Seconds from a number, or from an ISO date-time such as '2023-11-16 18:15:46.6805900'."""
    try:
        return float(text)
    except ValueError:
        pass
    head, dot, frac = text.strip().partition(".")
    if dot:  # datetime takes at most microseconds; production traces carry 100 ns ticks
        digits = len(frac) - len(frac.lstrip("0123456789"))
        frac = frac[: min(digits, 6)] + frac[digits:]
    try:
        return datetime.fromisoformat(head + dot + frac).timestamp()
    except ValueError:
        raise ValueError(f"TIMESTAMP {text!r} is neither a number nor an ISO date-time") from None


def read_trace(path: str | Path) -> list[TraceRow]:
    """Rows of a CSV with columns TIMESTAMP, ContextTokens, GeneratedTokens (other columns ignored),
    sorted by time."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in TRACE_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: missing column(s) {missing}; a trace needs {list(TRACE_COLUMNS)}")
        rows = []
        for line, row in enumerate(reader, start=2):
            try:
                rows.append(
                    TraceRow(
                        _parse_timestamp(row["TIMESTAMP"]),
                        int(row["ContextTokens"]),
                        int(row["GeneratedTokens"]),
                    )
                )
            except ValueError as e:
                raise ValueError(f"{path}, line {line}: {e}") from None
    if not rows:
        raise ValueError(f"{path}: the trace has no rows")
    return sorted(rows, key=lambda r: r.timestamp)


def trace_workload(
    rows: Sequence[TraceRow],
    tokens: TokenRange,
    max_model_len: int,
    time_scale: float = 1.0,
    max_prompt: int | None = None,
    max_output: int | None = None,
    limit: int | None = None,
    seed: int = 0,
) -> Workload:
    """Replay a trace: arrival = (t - t_first) * time_scale (0.01 plays 100 s in 1 s); lengths are
    clipped to max_prompt / max_output (and to max_model_len) so it fits this machine."""
    if not time_scale > 0:
        raise ValueError(f"time_scale must be positive, got {time_scale}")
    rows = list(rows)[:limit] if limit is not None else list(rows)
    if not rows:
        raise ValueError("no trace rows to replay")
    rng = np.random.default_rng([seed, 3])
    t0 = rows[0].timestamp
    requests = []
    for row in rows:
        prompt = max(1, min(row.context_tokens, max_prompt or row.context_tokens))
        output = max(1, min(row.generated_tokens, max_output or row.generated_tokens))
        prompt, output = _fit(prompt, output, max_model_len)
        requests.append(BenchRequest(tokens.sample(rng, prompt), output, (row.timestamp - t0) * time_scale))
    return Workload("trace", tuple(requests))
