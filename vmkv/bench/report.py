"""Results out: one JSON file with everything, a Markdown report, PNG plots.

Tables show the mean over repeats of each figure (with the range of the throughput when
there are several), so that A B A B interleaving shows what is drift and what is a difference.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from vmkv.bench.capacity import CapacityResult, format_bytes
from vmkv.bench.decode_speed import DecodeSpeed
from vmkv.bench.kernels import KernelMatrix, cell_key
from vmkv.bench.metrics import Distribution, RunMetrics
from vmkv.bench.offline import EngineSummary, RunResult
from vmkv.bench.workloads import rate_label

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MIB = 1 << 20


@dataclass
class BenchResults:
    meta: dict[str, object]
    capacity: list[CapacityResult] = field(default_factory=list)
    decode_speed: list[DecodeSpeed] = field(default_factory=list)
    kernels: KernelMatrix | None = None
    offline: list[RunResult] = field(default_factory=list)
    online: list[RunResult] = field(default_factory=list)


# ----------------------------------------------------------------------- JSON
def _plain(value: object) -> object:
    """JSON-safe: dataclasses to dicts, inf to "inf", NaN to null, dtypes to names."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
    if isinstance(value, torch.dtype):
        return _dtype_name(value)
    return value


def write_json(results: BenchResults, path: Path) -> None:
    path.write_text(json.dumps(_plain(results), indent=1) + "\n")


# -------------------------------------------------------------------- grouping
@dataclass
class Group:
    """The repeats of one target on one workload at one rate."""

    target: str
    workload: str
    rate: float
    runs: list[RunResult]

    def mean(self, get: Callable[[RunResult], float | None]) -> float:
        values = [v for r in self.runs if (v := get(r)) is not None and not math.isnan(v)]
        return sum(values) / len(values) if values else math.nan

    def spread(self, get: Callable[[RunResult], float]) -> tuple[float, float]:
        values = [get(r) for r in self.runs]
        return min(values), max(values)


def group_runs(results: Sequence[RunResult]) -> list[Group]:
    """Groups in first-seen order (targets keep the order they ran in)."""
    groups: dict[tuple[str, str, float], Group] = {}
    for r in results:
        key = (r.target, r.workload.split("@")[0], r.rate)
        groups.setdefault(key, Group(*key, [])).runs.append(r)
    return list(groups.values())


# -------------------------------------------------------------------- Markdown
def _num(value: float, digits: int = 1) -> str:
    return "–" if value is None or math.isnan(value) else f"{value:,.{digits}f}"


def _throughput(g: Group) -> str:
    mean = g.mean(lambda r: r.metrics.output_throughput)
    if len(g.runs) == 1:
        return _num(mean)
    low, high = g.spread(lambda r: r.metrics.output_throughput)
    return f"{_num(mean)} ({_num(low)}–{_num(high)})"


def _rate(rate: float) -> str:
    return "all at once" if math.isinf(rate) else f"{rate_label(rate)} req/s"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines + [""]


def _metric(g: Group, get: Callable[[RunMetrics], float]) -> float:
    return g.mean(lambda r: get(r.metrics))


def _engine(g: Group, get: Callable[[EngineSummary], float | None]) -> float:
    return g.mean(lambda r: get(r.engine))


def _counter(g: Group, name: str) -> str:
    """The group's mean of a KVStats field, or "–" where its layout does not report it (None)."""
    return _num(g.mean(lambda r: getattr(r.engine.kv, name)), 0)


def _median_p99(g: Group, get: Callable[[RunMetrics], Distribution], digits: int) -> str:
    median, p99 = _metric(g, lambda m: get(m).median), _metric(g, lambda m: get(m).p99)
    return f"{_num(median, digits)} / {_num(p99, digits)}"


def latency_table(groups: Sequence[Group], with_rate: bool) -> list[str]:
    header = [
        "target",
        *(["rate"] if with_rate else []),
        "output tok/s",
        "total tok/s",
        "req/s",
        "goodput req/s",
        "TTFT median / p99 ms",
        "TPOT median / p99 ms",
        "ITL p99 ms",
        "E2E median ms",
        "failed",
        "runs",
    ]
    rows = []
    for g in groups:
        rows.append(
            [
                g.target,
                *([_rate(g.rate)] if with_rate else []),
                _throughput(g),
                _num(_metric(g, lambda m: m.total_token_throughput)),
                _num(_metric(g, lambda m: m.request_throughput), 2),
                _num(_metric(g, lambda m: m.goodput), 2),
                _median_p99(g, lambda m: m.ttft, digits=0),
                _median_p99(g, lambda m: m.tpot, digits=1),
                _num(_metric(g, lambda m: m.itl.p99)),
                _num(_metric(g, lambda m: m.e2e.median), 0),
                str(sum(r.metrics.failed for r in g.runs)),
                str(len(g.runs)),
            ]
        )
    return _table(header, rows)


def layout_table(groups: Sequence[Group]) -> list[str]:
    """The layouts' own events: page maps (vattention), blocks and CoW (paged), memory, faults."""
    header = [
        "target",
        "peak seqs",
        "preemptions",
        "KV reserved",
        "peak allocated",
        "peak used",
        "waste at peak use",
        "OS minor faults",
        "map calls critical / background",
        "step time mapping",
        "mapper CPU / step time",
        "blocks allocated",
        "CoW copies",
        "prefix hit rate",
        "prefix hits (tokens)",
        "pages shared by forks",
        "swap out",
    ]
    rows = []
    for g in groups:
        if not all(r.engine for r in g.runs):
            continue
        share = _engine(g, lambda e: e.mapping_share)
        mapper = _engine(g, lambda e: e.mapper_share)
        hit = _engine(g, lambda e: e.prefix_cache_hit_rate)
        critical, background = _counter(g, "map_calls_critical"), _counter(g, "map_calls_background")
        rows.append(
            [
                g.target,
                _num(_engine(g, lambda e: e.peak_running_seqs), 0),
                _num(_engine(g, lambda e: e.preemptions), 0),
                format_bytes(_engine(g, lambda e: e.reserved_bytes)),
                format_bytes(_engine(g, lambda e: e.peak_allocated_bytes)),
                format_bytes(_engine(g, lambda e: e.peak_used_bytes)),
                format_bytes(_engine(g, lambda e: e.waste_at_peak_use_bytes)),
                _num(_engine(g, lambda e: e.os_minor_faults), 0),
                f"{critical} / {background}" if critical != "–" else "–",
                f"{share:.2%}" if not math.isnan(share) else "–",
                f"{mapper:.2%}" if not math.isnan(mapper) else "–",
                _counter(g, "blocks_allocated"),
                _counter(g, "cow_copies"),
                f"{hit:.1%}" if not math.isnan(hit) else "–",
                _counter(g, "prefix_cache_hits"),
                _counter(g, "fork_shared_pages"),
                format_bytes(g.mean(lambda r: r.engine.kv.swap_out_bytes)),
            ]
        )
    return _table(header, rows)


def capacity_table(results: Sequence[CapacityResult]) -> list[str]:
    base = results[0].sequences if results else 0
    rows = [
        [
            r.layout,
            str(r.sequences),
            f"{r.sequences / base:.1f}x" if base else "–",
            format_bytes(r.allocated_bytes),
            format_bytes(r.used_bytes),
            format_bytes(r.fragmentation_bytes),
        ]
        for r in results
    ]
    return _table(["layout", "sequences", "vs contiguous", "allocated", "used by tokens", "waste"], rows)


def decode_speed_table(results: Sequence[DecodeSpeed]) -> list[str]:
    """ms per layer of each order and decode path, and its ratio to that path's fastest order."""
    fastest = {
        a: min(r.ms_per_layer for r in results if r.attention == a) for a in {r.attention for r in results}
    }
    rows = [
        [r.order, r.attention, _num(r.ms_per_layer, 3), f"{r.ms_per_layer / fastest[r.attention]:.2f}x"]
        for r in results
    ]
    return _table(["order", "decode path", "ms per layer", "vs fastest order"], rows)


def kernel_tables(matrix: KernelMatrix) -> list[str]:
    kernels = list(dict.fromkeys(c.kernel for c in matrix.cells))
    layouts = list(dict.fromkeys(c.layout for c in matrix.cells))

    def describe(kernel: str, layout: str) -> str:
        c = matrix.cell(kernel, layout)
        text = c.status
        if c.max_error is not None:
            text += f" (max err {c.max_error:.1e})"
        elif c.note:
            text += f": {c.note}"
        return text.replace("|", "/")

    lines = _table(["kernel", *layouts], [[k, *(describe(k, lay) for lay in layouts)] for k in kernels])
    keys = [cell_key(b, ctx) for b in matrix.batches for ctx in matrix.contexts]
    rows = [
        [c.kernel, c.layout, *(_num(c.times_ms.get(key, math.nan), 3) for key in keys)]
        for c in matrix.cells
        if c.times_ms
    ]
    return (
        lines
        + ["Time per call in ms (best of several calls), one decode step of one layer:", ""]
        + _table(["kernel", "layout", *keys], rows)
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def write_markdown(results: BenchResults, path: Path, plots: Sequence[Path]) -> None:
    meta = results.meta
    lines = ["# vmkv benchmark", "", f"Command: `{meta.get('command', '')}`", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items() if k != "command"] + [""]
    if results.offline:
        groups = group_runs(results.offline)
        lines += ["## Offline (engine API, fresh engine per run, runs interleaved A B A B)", ""]
        for workload in dict.fromkeys(g.workload for g in groups):
            for rate in dict.fromkeys(g.rate for g in groups if g.workload == workload):
                chosen = [g for g in groups if g.workload == workload and g.rate == rate]
                lines += [f"### {workload}, {_rate(rate)}", ""]
                lines += latency_table(chosen, with_rate=False)
                lines += ["KV layout during the run:", ""] + layout_table(chosen)
    if results.online:
        groups = group_runs(results.online)
        lines += ["## Online (streaming HTTP client, same client for every server)", ""]
        for workload in dict.fromkeys(g.workload for g in groups):
            lines += [f"### {workload}", ""] + latency_table(
                [g for g in groups if g.workload == workload], True
            )
    if results.capacity:
        lines += [
            "## Capacity: concurrent sequences in one KV budget",
            "",
            f"Budget {format_bytes(results.capacity[0].budget_bytes)}; " + str(meta.get("capacity", "")),
            "",
        ]
        lines += capacity_table(results.capacity)
    if results.decode_speed:
        d = results.decode_speed[0]
        lines += [
            "## Decode attention per vattention order",
            "",
            f"One decode step of {d.batch} sequences at {d.context} tokens, every layer in turn, "
            f"{format_bytes(d.page_size)} pages; best of several rounds, orders interleaved.",
            "",
        ]
        lines += decode_speed_table(results.decode_speed)
    if results.kernels:
        m = results.kernels
        lines += [
            "## Kernel compatibility",
            "",
            f"Decode attention, {m.shape.num_q_heads} query heads over {m.shape.num_kv_heads} KV heads of "
            f"{m.shape.head_dim}, {_dtype_name(m.shape.dtype)}, blocks of {m.shape.block_size} tokens, "
            f"on {m.device}; error is the largest absolute difference to an fp32 reference.",
            "",
        ]
        lines += kernel_tables(m)
    if plots:
        lines += ["## Plots", ""] + [f"![{p.stem}]({p.parent.name}/{p.name})" for p in plots] + [""]
    path.write_text("\n".join(lines))


# ----------------------------------------------------------------------- plots
def _figure(**size: object) -> Figure:
    """matplotlib's object API (files only, no pyplot state or window), imported here: it is
    0.4 s of every `vmkv` process's start, and only the report draws."""
    from matplotlib.figure import Figure

    return Figure(**size)


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return path


def plot_rate_sweep(results: Sequence[RunResult], path: Path) -> Path | None:
    """Output tokens/s and median TPOT against request rate, one line per target."""
    groups = group_runs(results)
    rates = sorted({g.rate for g in groups})
    if len(rates) < 2:
        return None
    fig = _figure(figsize=(10, 4))
    ax_tput, ax_tpot = fig.subplots(1, 2)
    labels = [_rate(r).replace(" req/s", "") for r in rates]
    for target in dict.fromkeys(g.target for g in groups):
        points = {g.rate: g for g in groups if g.target == target}
        xs = [i for i, r in enumerate(rates) if r in points]
        ax_tput.plot(
            xs, [points[rates[i]].mean(lambda r: r.metrics.output_throughput) for i in xs], "o-", label=target
        )
        ax_tpot.plot(
            xs, [points[rates[i]].mean(lambda r: r.metrics.tpot.median) for i in xs], "o-", label=target
        )
    for ax, title in ((ax_tput, "output tokens/s"), (ax_tpot, "median TPOT (ms)")):
        ax.set_xticks(range(len(rates)), labels)
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax_tput.legend()
    return _save(fig, path)


def plot_ttft_cdf(results: Sequence[RunResult], path: Path) -> Path | None:
    """TTFT CDF per target over every run of the first workload at its highest rate."""
    if not results:
        return None
    first = results[0].workload.split("@")[0]
    rate = max(r.rate for r in results if r.workload.split("@")[0] == first)
    fig = _figure(figsize=(6, 4))
    ax = fig.subplots()
    for g in group_runs(results):
        if g.workload != first or g.rate != rate:
            continue
        ttfts = sorted(t for r in g.runs for t in r.ttfts_ms)
        if ttfts:
            ax.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=g.target)
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF: {first}, {_rate(rate)}")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_kv_memory(results: Sequence[RunResult], path: Path) -> Path | None:
    """Allocated (solid) and used (dashed) KV bytes over time, first run of each engine target."""
    firsts = {}
    for r in results:
        if r.engine and r.engine.timeline and r.target not in firsts:
            firsts[r.target] = r
    if not firsts:
        return None
    fig = _figure(figsize=(7, 4))
    ax = fig.subplots()
    for target, r in firsts.items():
        t = [s.t for s in r.engine.timeline]
        (line,) = ax.plot(
            t, [s.allocated_bytes / MIB for s in r.engine.timeline], label=f"{target} allocated"
        )
        ax.plot(
            t,
            [s.used_bytes / MIB for s in r.engine.timeline],
            "--",
            color=line.get_color(),
            label=f"{target} used",
        )
    ax.set_xlabel("seconds")
    ax.set_ylabel("KV memory (MiB)")
    first = next(iter(firsts.values()))
    ax.set_title(f"KV memory over time: {first.workload.split('@')[0]}, {_rate(first.rate)}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_capacity(results: Sequence[CapacityResult], path: Path) -> Path | None:
    if not results:
        return None
    fig = _figure(figsize=(8, 1.5 + 0.45 * len(results)))
    ax = fig.subplots()
    bars = ax.barh([r.layout for r in results], [r.sequences for r in results])
    ax.bar_label(bars, padding=3)
    ax.invert_yaxis()  # contiguous, the reference, on top
    ax.set_xlabel("concurrent sequences")
    ax.set_title(f"Sequences in {format_bytes(results[0].budget_bytes)} of KV")
    return _save(fig, path)


def plot_kernel_times(matrix: KernelMatrix | None, path: Path) -> Path | None:
    """Time per call against context length at the largest batch, one panel per layout."""
    if matrix is None or len(matrix.contexts) < 2:
        return None
    batch = max(matrix.batches)
    layouts = list(dict.fromkeys(c.layout for c in matrix.cells))
    fig = _figure(figsize=(5 * len(layouts), 4))
    axes = fig.subplots(1, len(layouts), sharey=True, squeeze=False)[0]
    for ax, layout in zip(axes, layouts, strict=True):
        for c in matrix.cells:
            if c.layout != layout or not c.times_ms:
                continue
            points = [
                (ctx, c.times_ms[cell_key(batch, ctx)])
                for ctx in matrix.contexts
                if cell_key(batch, ctx) in c.times_ms
            ]
            ax.plot(*zip(*points, strict=True), "o-", label=c.kernel)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length (tokens)")
        ax.set_title(f"{layout}, batch {batch}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("ms per call")
    axes[0].legend(fontsize=7)
    return _save(fig, path)


def write_report(results: BenchResults, out_dir: Path) -> list[Path]:
    """results.json, report.md and plots/*.png under out_dir; returns the files written."""
    plot_dir = out_dir / "plots"
    plot_dir.mkdir(parents=True, exist_ok=True)
    sweep = results.online or results.offline
    plots = [
        p
        for p in (
            plot_rate_sweep(sweep, plot_dir / "rate_sweep.png"),
            plot_ttft_cdf(results.offline or results.online, plot_dir / "ttft_cdf.png"),
            plot_kv_memory(results.offline, plot_dir / "kv_memory.png"),
            plot_capacity(results.capacity, plot_dir / "capacity.png"),
            plot_kernel_times(results.kernels, plot_dir / "kernel_time.png"),
        )
        if p is not None
    ]
    write_json(results, out_dir / "results.json")
    write_markdown(results, out_dir / "report.md", plots)
    return [out_dir / "results.json", out_dir / "report.md", *plots]
