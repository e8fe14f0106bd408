"""Prometheus text exposition (format 0.0.4) of the serving metrics, written by hand.

The metrics vLLM also has carry its names, prefix `vllm:` included, so the dashboards and
alerts people run against vLLM read them unchanged; those only vmkv has (KV memory, the
layout's KVStats) carry the prefix `vmkv:`. Latencies are measured here, where
the tokens leave for the client; queue and cache figures are read from the engine at
scrape time. Everything is touched only from the event loop, so no locks are needed.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field

from vmkv.engine import EngineStats
from vmkv.engine.sequence import FinishReason

logger = logging.getLogger(__name__)

COMMON_PREFIX = "vllm:"  # names and meanings as vLLM exports them
PREFIX = "vmkv:"  # vmkv's own
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS = tuple(str(reason) for reason in FinishReason)

# Bucket bounds of the common serving convention, so existing dashboards read these unchanged.
# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                         2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)
# fmt: on


@dataclass
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...]
    counts: list[int] = field(init=False)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        index = bisect.bisect_left(self.buckets, value)
        if index < len(self.buckets):
            self.counts[index] += 1
        self.sum += value
        self.count += 1


class RequestTimer:
    """Times one request from arrival to finish; feeds the latency histograms once it ends, and
    with request logging on, logs one line saying what it did."""

    def __init__(self, metrics: ServingMetrics, request_id: str, session_id: str | None = None) -> None:
        self.metrics = metrics
        self.request_id = request_id
        self.session_id = session_id
        self.arrival = time.perf_counter()
        self.first_token: float | None = None
        self.last_token: float | None = None

    def on_tokens(self) -> None:
        """Call each time new tokens are about to be sent (one engine step's worth)."""
        now = time.perf_counter()
        if self.first_token is None:
            self.first_token = now
            self.metrics.ttft.observe(now - self.arrival)
        else:
            self.metrics.itl.observe(now - self.last_token)
        self.last_token = now

    def on_finish(
        self, prompt_tokens: int, generated_tokens: int, longest_output: int, finish_reasons: list[str]
    ) -> None:
        """`longest_output` is the longest sample's length: the number of decode steps taken;
        `finish_reasons` holds one entry per sample (vLLM's v1 counts each sample as a request)."""
        now = time.perf_counter()
        if self.metrics.log_requests:
            ttft = "-" if self.first_token is None else f"{self.first_token - self.arrival:.3f} s"
            logger.info(
                "request %s%s finished (%s): %d prompt tokens, %d generated, first token after %s, "
                "%.3f s in all",
                self.request_id,
                "" if self.session_id is None else f" of session {self.session_id}",
                ", ".join(sorted(set(finish_reasons))) or "-",
                prompt_tokens,
                generated_tokens,
                ttft,
                now - self.arrival,
            )
        self.metrics.request_success.update(finish_reasons)
        self.metrics.prompt_tokens += prompt_tokens
        self.metrics.generation_tokens += generated_tokens
        self.metrics.e2e.observe(now - self.arrival)
        if self.first_token is not None and longest_output > 1:
            self.metrics.tpot.observe((now - self.first_token) / (longest_output - 1))


class ServingMetrics:
    def __init__(self, model_name: str, log_requests: bool = False, max_loras: int = 0) -> None:
        self.labels = {"model_name": model_name}
        self.max_loras = max_loras  # with LoRA adapters served: vLLM's lora_requests_info gauge
        self.log_requests = log_requests  # one log line per finished request (--enable-log-requests)
        self.request_success: Counter[str] = Counter()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = Histogram(
            "inter_token_latency_seconds", "Time between streamed steps.", TOKEN_LATENCY_BUCKETS
        )
        self.tpot = Histogram(
            "request_time_per_output_token_seconds",
            "Decode time per output token, per request.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = Histogram("e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS)

    def timer(self, request_id: str, session_id: str | None = None) -> RequestTimer:
        return RequestTimer(self, request_id, session_id)

    def render(self, engines: list[EngineStats], front: dict[str, Sample] | None = None) -> str:
        """What the engines report (one per data-parallel replica, labelled `replica` when there
        are several), what this front end measured, and `front`: vmkv's own figures of this
        front end's state (the response store's)."""
        labels = [self.labels]
        if len(engines) > 1:
            labels = [{**self.labels, "replica": str(r)} for r in range(len(engines))]
        common, own = zip(*(engine_samples(engine) for engine in engines), strict=True)
        out: list[str] = []
        self._engine_samples(out, COMMON_PREFIX, common, labels)
        for name, help_text, value in (
            ("prompt_tokens_total", "Prompt tokens of finished requests.", self.prompt_tokens),
            ("generation_tokens_total", "Tokens generated for finished requests.", self.generation_tokens),
        ):
            self._sample(out, COMMON_PREFIX + name, "counter", help_text, [(self.labels, value)])
        self._request_success(out)
        self._accepted_per_position(out, engines, labels)
        if self.max_loras:
            self._lora_info(out, engines)
        for histogram in (self.ttft, self.itl, self.tpot, self.e2e):
            self._histogram(out, histogram)
        self._engine_samples(out, PREFIX, own, labels)
        for name, (kind, help_text, value) in (front or {}).items():
            self._sample(out, PREFIX + name, kind, help_text, [(self.labels, value)])
        return "\n".join(out) + "\n"

    def _engine_samples(
        self,
        out: list[str],
        prefix: str,
        per_engine: tuple[dict[str, Sample], ...],
        labels: list[dict[str, str]],
    ) -> None:
        for name in dict.fromkeys(name for samples in per_engine for name in samples):
            present = [
                (where, samples[name])
                for where, samples in zip(labels, per_engine, strict=True)
                if name in samples
            ]
            kind, help_text, _ = present[0][1]
            self._sample(
                out, prefix + name, kind, help_text, [(where, sample[2]) for where, sample in present]
            )

    def _lora_info(self, out: list[str], engines: list[EngineStats]) -> None:
        """vLLM's gauge for LoRA-aware routers: the adapters running and waiting, in its labels
        (comma-separated names), and the time of the reading as its value."""
        labels = {
            "max_lora": str(self.max_loras),
            "running_lora_adapters": ",".join(dict.fromkeys(n for e in engines for n in e.running_loras)),
            "waiting_lora_adapters": ",".join(dict.fromkeys(n for e in engines for n in e.waiting_loras)),
        }
        help_text = "Running and waiting LoRA adapters (labels); the value is when they were read."
        self._sample(out, COMMON_PREFIX + "lora_requests_info", "gauge", help_text, [(labels, time.time())])

    def _accepted_per_position(
        self, out: list[str], engines: list[EngineStats], labels: list[dict[str, str]]
    ) -> None:
        """vLLM's counter of accepted draft tokens by their position in the draft (label
        `position`, from 0), with speculative decoding on: where acceptance falls off tells
        how long drafts are worth making."""
        values = [
            ({**where, "position": str(p)}, count)
            for where, engine in zip(labels, engines, strict=True)
            for p, count in enumerate(engine.spec_accepted_per_position)
        ]
        if values:
            name = COMMON_PREFIX + "spec_decode_num_accepted_tokens_per_pos_total"
            self._sample(out, name, "counter", "Accepted draft tokens by position in the draft.", values)

    def _request_success(self, out: list[str]) -> None:
        name = COMMON_PREFIX + "request_success_total"
        out += [f"# HELP {name} Finished requests by finish reason.", f"# TYPE {name} counter"]
        for reason in FINISH_REASONS:
            labels = format_labels({**self.labels, "finished_reason": reason})
            out.append(f"{name}{labels} {format_value(self.request_success[reason])}")

    def _sample(
        self, out: list[str], name: str, kind: str, help_text: str, values: list[tuple[dict[str, str], float]]
    ) -> None:
        out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        out += [f"{name}{format_labels(labels)} {format_value(value)}" for labels, value in values]

    def _histogram(self, out: list[str], histogram: Histogram) -> None:
        name = COMMON_PREFIX + histogram.name
        out += [f"# HELP {name} {histogram.help}", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, count in zip(histogram.buckets, histogram.counts, strict=True):
            cumulative += count
            labels = format_labels({**self.labels, "le": format_value(bound)})
            out.append(f"{name}_bucket{labels} {cumulative}")
        out.append(f"{name}_bucket{format_labels({**self.labels, 'le': '+Inf'})} {histogram.count}")
        out.append(f"{name}_sum{format_labels(self.labels)} {format_value(histogram.sum)}")
        out.append(f"{name}_count{format_labels(self.labels)} {histogram.count}")


Sample = tuple[str, str, float]  # kind, help, value


def engine_samples(engine: EngineStats) -> tuple[dict[str, Sample], dict[str, Sample]]:
    """One engine's samples by name: those vLLM also exports, then vmkv's own."""
    memory, kv = engine.memory, engine.kv_stats
    common = {
        "num_requests_running": ("gauge", "Requests in the running batch.", engine.num_running),
        "num_requests_waiting": (
            "gauge",
            "Requests waiting, preempted or swapped out.",
            engine.num_waiting + engine.num_swapped,
        ),
        "kv_cache_usage_perc": ("gauge", "Fraction of the KV budget in use (1 = 100%).", engine.kv_usage),
        "num_preemptions_total": ("counter", "Sequences preempted.", engine.num_preemptions),
        "prefix_cache_queries_total": (
            "counter",
            "Prompt tokens looked up in the prefix cache.",
            engine.prefix_cache_queries,
        ),
        "prefix_cache_hits_total": (
            "counter",
            "Prompt tokens found in the prefix cache.",
            engine.prefix_cache_hits,
        ),
        "spec_decode_num_drafts_total": ("counter", "Speculative drafts verified.", engine.spec_drafts),
        "spec_decode_num_draft_tokens_total": ("counter", "Draft tokens verified.", engine.spec_draft_tokens),
        "spec_decode_num_accepted_tokens_total": ("counter", "Tokens accepted.", engine.spec_accepted_tokens),
    }
    own = {
        "kv_cache_reserved_bytes": (
            "gauge",
            "KV address space or up-front reservation.",
            memory.reserved_bytes,
        ),
        "kv_cache_allocated_bytes": ("gauge", "KV physical memory held.", memory.allocated_bytes),
        "kv_cache_used_bytes": ("gauge", "KV bytes of stored tokens.", memory.used_bytes),
        "kv_cache_fragmentation_bytes": ("gauge", "KV allocated minus used.", memory.fragmentation_bytes),
        "engine_paused": ("gauge", "1 while the engine is paused or asleep.", engine.paused),
        "engine_sleep_level": (
            "gauge",
            "0 awake, 1 KV memory given back, 2 weights dropped too.",
            engine.sleep_level,
        ),
    }
    own.update(
        (f"kv_{name}", ("gauge", f"KV layout {name.replace('units', kv.unit + 's')}.", value))
        for name, value in kv.present().items()
    )
    return common, own


def format_labels(labels: dict[str, str]) -> str:
    return "{" + ",".join(f'{key}="{escape_label(value)}"' for key, value in labels.items()) + "}"


def escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def format_value(value: float) -> str:
    if isinstance(value, bool):
        value = int(value)
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))
