"""Per-request latencies and per-run aggregates, with the serving-benchmark conventions.

- TTFT: send (or arrival) to the first chunk that carries tokens.
- ITL: gaps between consecutive chunks.
- TPOT: (latency - TTFT) / (output tokens per sample - 1).
- E2E: send to the last chunk.
- Goodput: requests per second that met every SLO given.
Percentiles interpolate linearly (numpy's default), as common serving benchmarks do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestRecord:
    """What one client saw of one request; times in seconds on the run's clock."""

    prompt_tokens: int
    output_tokens: int  # over all n samples
    start: float
    chunk_times: list[float] = field(default_factory=list)  # one per chunk that carried tokens
    end: float | None = None
    n: int = 1
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times) and self.end is not None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def tpot(self) -> float | None:
        per_sample = self.output_tokens / self.n
        if not self.ok or per_sample <= 1:
            return None
        return (self.e2e - self.ttft) / (per_sample - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


@dataclass(frozen=True)
class SLO:
    """Latency objectives in milliseconds; None means no objective on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def met(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        checks = ((self.ttft_ms, record.ttft), (self.tpot_ms, record.tpot), (self.e2e_ms, record.e2e))
        return all(limit is None or value is None or value * 1e3 <= limit for limit, value in checks)

    def describe(self) -> str:
        limits = [
            f"{name} <= {limit:g} ms"
            for name, limit in (("TTFT", self.ttft_ms), ("TPOT", self.tpot_ms), ("E2E", self.e2e_ms))
            if limit is not None
        ]
        return ", ".join(limits) or "none (every completed request counts)"

    @classmethod
    def parse(cls, text: str) -> SLO:
        """'ttft:2000,tpot:200' (milliseconds) -> SLO."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = part.partition(":")
            if not sep or name not in ("ttft", "tpot", "e2e"):
                raise ValueError(f"an SLO is ttft:MS, tpot:MS or e2e:MS, got {part!r}")
            try:
                values[f"{name}_ms"] = float(value)
            except ValueError:
                raise ValueError(f"SLO {name} needs a number of milliseconds, got {value!r}") from None
            if values[f"{name}_ms"] <= 0:
                raise ValueError(f"SLO {name} must be positive, got {value}")
        return cls(**values)


@dataclass(frozen=True)
class Distribution:
    """Summary of a latency sample, in milliseconds (NaN when the sample is empty)."""

    count: int
    mean: float
    median: float
    p90: float
    p99: float

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls(0, math.nan, math.nan, math.nan, math.nan)
        ms = np.asarray(values, dtype=np.float64) * 1e3
        p50, p90, p99 = np.percentile(ms, [50, 90, 99])
        return cls(len(ms), float(ms.mean()), float(p50), float(p90), float(p99))


@dataclass(frozen=True)
class RunMetrics:
    completed: int
    failed: int
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (prompt + output) tokens / s
    goodput: float  # requests meeting every SLO / s
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution


def compute_metrics(
    records: Sequence[RequestRecord], duration_s: float, slo: SLO | None = None
) -> RunMetrics:
    """Aggregate a run; duration_s is first send to last completion."""
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    done = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in done)
    output = sum(r.output_tokens for r in done)
    good = sum(1 for r in done if (slo or SLO()).met(r))
    return RunMetrics(
        completed=len(done),
        failed=len(records) - len(done),
        duration_s=duration_s,
        prompt_tokens=prompt,
        output_tokens=output,
        request_throughput=len(done) / duration_s,
        output_throughput=output / duration_s,
        total_token_throughput=(prompt + output) / duration_s,
        goodput=good / duration_s,
        ttft=Distribution.of_seconds([r.ttft for r in done]),
        tpot=Distribution.of_seconds([t for r in done if (t := r.tpot) is not None]),
        itl=Distribution.of_seconds([gap for r in done for gap in r.itls]),
        e2e=Distribution.of_seconds([r.e2e for r in done]),
    )
