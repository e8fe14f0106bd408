"""Offline benchmark: a workload through the engine API, per KV mode, interleaved A B A B.

The engine is driven step by step (not through `LLM.generate`) so that requests can
arrive on a schedule and every step can be timed and sampled: each request's chunks are
stamped when the step that produced them returns, and after each step the cache's memory
and units in use are recorded, giving KV memory over time. Every run builds a fresh engine,
so no run inherits another's prefix cache or kept pages.
"""

from __future__ import annotations

import dataclasses
import math
import resource
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from vmkv.bench.metrics import SLO, RequestRecord, RunMetrics, compute_metrics
from vmkv.bench.workloads import BenchRequest, Workload, rate_label
from vmkv.engine import EngineConfig, EngineStats, LLMEngine, RequestOutput, RequestRejected, SamplingParams
from vmkv.kv_cache import KVStats

MAX_TIMELINE_POINTS = 300


@dataclass
class KVSample:
    """The cache after one step."""

    t: float  # seconds since the run started
    running_seqs: int
    allocated_bytes: int
    used_bytes: int
    units_in_use: float  # KVStats.units_in_use: physical pages, blocks or slots held


@dataclass
class EngineSummary:
    """What the engine and its KV layout did during one run (kv holds deltas over the run)."""

    steps: int
    step_seconds: float
    peak_running_seqs: int
    preemptions: int
    os_minor_faults: int  # the whole process, during the run (getrusage)
    mapping_share: float | None  # vattention: critical-path map seconds / step seconds
    mapper_share: float | None  # vattention: the background mapper's CPU seconds / step seconds
    prefix_cache_hit_rate: float | None
    reserved_bytes: int
    peak_allocated_bytes: int
    peak_used_bytes: int
    waste_at_peak_use_bytes: int  # allocated minus used when the cache held the most tokens
    kv: KVStats  # deltas: meaningful for the event counts, not for gauges
    timeline: list[KVSample] = field(default_factory=list)


@dataclass
class RunOutcome:
    """What a target reports for one run."""

    records: list[RequestRecord]
    duration_s: float  # first arrival to last completion
    engine: EngineSummary | None = None  # when the engine was driven in this process
    server_metrics: dict[str, float] | None = None  # a server's /metrics over the run (deltas)


@dataclass
class RunResult:
    target: str
    workload: str
    rate: float
    repeat: int
    metrics: RunMetrics
    ttfts_ms: list[float]
    engine: EngineSummary | None = None
    server_metrics: dict[str, float] | None = None

    @property
    def rate_label(self) -> str:
        return rate_label(self.rate)


@dataclass
class Target:
    name: str
    run: Callable[[Workload], RunOutcome]


@dataclass(frozen=True)
class Round:
    """One workload (arrivals set) that every target runs once."""

    workload: Workload
    rate: float
    repeat: int


def sampling_params(request: BenchRequest, index: int) -> SamplingParams:
    """Exactly max_tokens each (ignore_eos); greedy, or seeded sampling when n > 1 so samples differ."""
    if request.n == 1:
        return SamplingParams(max_tokens=request.max_tokens, ignore_eos=True, temperature=0.0)
    return SamplingParams(
        n=request.n, max_tokens=request.max_tokens, ignore_eos=True, temperature=1.0, seed=index
    )


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _warm_up(engine: LLMEngine) -> None:
    """One tiny request, so one-time costs (first kernel calls, lazy builds) stay out of the run."""
    engine.add_request(
        "warm-up", [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)
    )
    while engine.has_unfinished_requests():
        engine.step()


def announce_arrivals(
    engine: LLMEngine, requests: Sequence[BenchRequest], order: list[int], t0: float, stop: threading.Event
) -> threading.Thread:
    """A thread telling the engine of each request at its arrival time, as a server's receiving
    thread does (AsyncLLM, the engine process): the loop below adds requests only between steps,
    so without it one arriving while a step computes is heard of only when the step returns, too
    late for the KV cache to back it meanwhile (LLMEngine.prompts_arrived). Requests there at the
    start are added before the first step: nothing computes while they could be backed."""

    def announce() -> None:
        for i in order:
            if requests[i].arrival <= 0:
                continue
            if stop.wait(max(0.0, requests[i].arrival - (time.perf_counter() - t0))):
                return
            engine.prompts_arrived([(requests[i].prompt_ids, None)])

    thread = threading.Thread(target=announce, name="vmkv-bench-arrivals", daemon=True)
    thread.start()
    return thread


def drive_engine(engine: LLMEngine, workload: Workload) -> RunOutcome:
    """Submit each request at its arrival time, step until all finish, stamp every chunk."""
    requests = workload.requests
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    records = [RequestRecord(r.prompt_len, 0, r.arrival, n=r.n) for r in requests]
    before = engine.stats()
    faults_before = _minor_faults()
    timeline: list[KVSample] = []
    t0 = time.perf_counter()
    stop = threading.Event()
    announcer = announce_arrivals(engine, requests, order, t0, stop)
    try:
        step_seconds = _step_until_done(engine, requests, order, records, timeline, t0)
    finally:
        stop.set()
        announcer.join()
    duration = time.perf_counter() - t0
    summary = _summarize(engine, before, timeline, step_seconds, _minor_faults() - faults_before)
    return RunOutcome(records, duration, summary)


def _step_until_done(
    engine: LLMEngine,
    requests: Sequence[BenchRequest],
    order: list[int],
    records: list[RequestRecord],
    timeline: list[KVSample],
    t0: float,
) -> float:
    """Add the requests that have arrived, step, record; until every request finished.
    Returns the seconds spent in steps."""
    step_seconds = 0.0
    submitted = 0
    while submitted < len(order) or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while submitted < len(order) and requests[order[submitted]].arrival <= now:
            i = order[submitted]
            try:
                engine.add_request(str(i), list(requests[i].prompt_ids), sampling_params(requests[i], i))
            except RequestRejected as e:
                records[i].error = f"rejected: {e}"
            submitted += 1
        if not engine.has_unfinished_requests():
            if submitted < len(order):
                time.sleep(max(0.0, requests[order[submitted]].arrival - now))
            continue
        s0 = time.perf_counter()
        outputs = engine.step()
        s1 = time.perf_counter()
        step_seconds += s1 - s0
        t = s1 - t0
        for out in outputs:
            _record_output(records[int(out.request_id)], out, t)
        memory = engine.cache.memory()
        units = engine.cache.stats().units_in_use
        timeline.append(
            KVSample(t, engine.scheduler.num_running_seqs, memory.allocated_bytes, memory.used_bytes, units)
        )
    return step_seconds


def _record_output(record: RequestRecord, out: RequestOutput, t: float) -> None:
    """A step's output of one request: a chunk if it brought tokens, the end if it finished."""
    tokens = sum(len(c.token_ids) for c in out.outputs)
    if tokens > record.output_tokens:
        record.chunk_times.append(t)
        record.output_tokens = tokens
    if out.finished:
        record.end = t
        reasons = {c.finish_reason for c in out.outputs}
        if reasons & {"error", "abort"}:
            record.error = out.error or ", ".join(sorted(r for r in reasons if r))


def _summarize(
    engine: LLMEngine, before: EngineStats, timeline: list[KVSample], step_seconds: float, faults: int
) -> EngineSummary:
    after = engine.stats()
    kv = after.kv_stats.since(before.kv_stats)
    queries, hits = kv.prefix_cache_queries, kv.prefix_cache_hits
    map_critical = kv.map_seconds_critical
    mapper_cpu = kv.mapper_cpu_seconds
    peak_allocated, peak_used, waste = memory_peaks(timeline)
    return EngineSummary(
        steps=len(timeline),
        step_seconds=step_seconds,
        peak_running_seqs=after.peak_running_seqs,
        preemptions=after.num_preemptions - before.num_preemptions,
        os_minor_faults=faults,
        mapping_share=map_critical / step_seconds if map_critical is not None and step_seconds else None,
        mapper_share=mapper_cpu / step_seconds if mapper_cpu is not None and step_seconds else None,
        prefix_cache_hit_rate=hits / queries if queries else None,
        reserved_bytes=after.memory.reserved_bytes,
        peak_allocated_bytes=peak_allocated,
        peak_used_bytes=peak_used,
        waste_at_peak_use_bytes=waste,
        kv=kv,
        timeline=downsample(timeline, MAX_TIMELINE_POINTS),
    )


def memory_peaks(timeline: Sequence[KVSample]) -> tuple[int, int, int]:
    """Peak allocated bytes, peak used bytes, and the waste (allocated - used) when use peaked.

    Waste is taken when the cache held the most tokens, not when allocation peaked: vattention
    keeps finished sequences' pages mapped for reuse, so its allocation peaks as the last
    sequences finish, with nothing used, and waste there would read as the whole allocation.
    """
    if not timeline:
        return 0, 0, 0
    fullest = max(timeline, key=lambda s: s.used_bytes)
    peak_allocated = max(s.allocated_bytes for s in timeline)
    return peak_allocated, fullest.used_bytes, fullest.allocated_bytes - fullest.used_bytes


def downsample(samples: Sequence[KVSample], limit: int) -> list[KVSample]:
    """At most `limit` samples, evenly spaced, always keeping the last."""
    if len(samples) <= limit:
        return list(samples)
    stride = math.ceil(len(samples) / limit)
    kept = list(samples[::stride])
    if kept[-1] is not samples[-1]:
        kept.append(samples[-1])
    return kept


def engine_target(config: EngineConfig) -> Target:
    """One kv mode of our engine; a fresh engine per run."""

    def run(workload: Workload) -> RunOutcome:
        engine = LLMEngine(config)
        try:
            _warm_up(engine)
            return drive_engine(engine, workload)
        finally:
            engine.close()

    return Target(config.kv_mode, run)


def engine_targets(base: EngineConfig, kv_modes: Sequence[str]) -> list[Target]:
    return [engine_target(dataclasses.replace(base, kv_mode=mode)) for mode in kv_modes]


def run_interleaved(
    targets: Sequence[Target],
    rounds: Sequence[Round],
    slo: SLO | None = None,
    on_run: Callable[[str], None] | None = None,
) -> list[RunResult]:
    """Every round through every target in turn (A B A B), so slow drift of the machine
    spreads over all targets instead of favouring whichever ran first."""
    results = []
    for r in rounds:
        for target in targets:
            if on_run:
                on_run(f"{target.name} {r.workload.name} #{r.repeat + 1}")
            outcome = target.run(r.workload)
            metrics = compute_metrics(outcome.records, outcome.duration_s, slo)
            ttfts = sorted(rec.ttft * 1e3 for rec in outcome.records if rec.ok)
            results.append(
                RunResult(
                    target.name,
                    r.workload.name,
                    r.rate,
                    r.repeat,
                    metrics,
                    ttfts,
                    outcome.engine,
                    outcome.server_metrics,
                )
            )
    return results
