"""The benchmark suite: workloads, metric math, capacity, kernel matrix, the client, a tiny end-to-end run."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from vmkv.bench.capacity import KIB, MIB, CapacityScenario, measure_capacity
from vmkv.bench.cli import add_bench_arguments, bench_main
from vmkv.bench.kernels import (
    BLOCK_TABLE,
    DOES_NOT_RUN,
    GATHER,
    NOT_INSTALLED,
    PACKED,
    PAGED,
    UNMODIFIED,
    VIRTUAL,
    WRONG_RESULT,
    AttentionShape,
    Kernel,
    kernel_matrix,
    max_error_allowed,
    reference_attention,
)
from vmkv.bench.metrics import SLO, Distribution, RequestRecord, compute_metrics
from vmkv.bench.offline import (
    KVSample,
    Round,
    RunOutcome,
    Target,
    announce_arrivals,
    memory_peaks,
    run_interleaved,
)
from vmkv.bench.online import parse_peer_urls, parse_prometheus, run_online
from vmkv.bench.peers import transformers_target
from vmkv.bench.workloads import (
    BenchRequest,
    TokenRange,
    TraceRow,
    Workload,
    WorkloadSpec,
    arrival_times,
    make_workload,
    parse_rates,
    read_trace,
    trace_workload,
)
from vmkv.engine import EngineConfig
from vmkv.kv_cache import KVShape

TOKENS = TokenRange(10, 1000)


def spec(num: int = 400, seed: int = 0, max_model_len: int = 2048) -> WorkloadSpec:
    return WorkloadSpec(num, TOKENS, max_model_len, seed)


def lengths(workload: Workload) -> tuple[np.ndarray, np.ndarray]:
    return (
        np.array([r.prompt_len for r in workload.requests]),
        np.array([r.max_tokens for r in workload.requests]),
    )


# ------------------------------------------------------------------ workloads
@pytest.mark.parametrize("name", ["chat", "document", "fixed", "shared-prefix", "parallel", "long-context"])
def test_workloads_are_deterministic_valid_and_seed_dependent(name: str) -> None:
    a, b, other = make_workload(name, spec()), make_workload(name, spec()), make_workload(name, spec(seed=1))
    assert a == b
    assert a != other
    for r in a.requests:
        assert r.prompt_len >= 1 and r.max_tokens >= 1
        assert r.prompt_len + r.max_tokens <= 2048
        assert all(TOKENS.low <= t < TOKENS.high for t in r.prompt_ids)


def test_length_distributions_have_their_documented_shape() -> None:
    chat_prompts, chat_outputs = lengths(make_workload("chat", spec(2000)))
    assert 55 <= np.median(chat_prompts) <= 75 and 85 <= np.median(chat_outputs) <= 110
    assert np.mean(chat_outputs) > np.median(chat_outputs) * 1.2  # long tail to the right
    doc_prompts, doc_outputs = lengths(make_workload("document", spec(2000)))
    assert np.median(doc_prompts) > 20 * np.median(doc_outputs)
    fixed = make_workload("fixed", spec(50))
    assert {(r.prompt_len, r.max_tokens) for r in fixed.requests} == {(256, 128)}
    from vmkv.bench.workloads import fixed as fixed_workload

    ranged = fixed_workload(spec(500), prompt_len=100, output_len=40, range_ratio=0.5)
    p, o = lengths(ranged)
    assert p.min() >= 50 and p.max() <= 100 and o.min() >= 20 and o.max() <= 40 and len(set(p)) > 20
    with pytest.raises(ValueError, match="range_ratio"):
        fixed_workload(spec(), range_ratio=0.0)


def test_shared_prefix_parallel_and_long_context_workloads() -> None:
    shared = make_workload("shared-prefix", spec(20))
    system = shared.requests[0].prompt_ids[:512]
    assert all(r.prompt_ids[:512] == system and r.prompt_len > 512 for r in shared.requests)
    assert len({r.prompt_ids[512:] for r in shared.requests}) == 20
    assert {r.n for r in make_workload("parallel", spec(10)).requests} == {4}
    p, o = lengths(make_workload("long-context", spec(50, max_model_len=1024)))
    assert p.min() >= (1024 - 32) * 3 // 4 and (p + o).max() <= 1024


def test_length_clipping_and_spec_validation() -> None:
    clipped = make_workload("chat", WorkloadSpec(300, TOKENS, 2048, max_prompt=40, max_output=16))
    p, o = lengths(clipped)
    assert p.max() == 40 and o.max() == 16 and o.min() >= 4
    tight = make_workload("document", spec(100, max_model_len=128))
    assert max(r.prompt_len + r.max_tokens for r in tight.requests) <= 128
    for bad in (dict(num_requests=0), dict(max_output=0), dict(max_model_len=8)):
        with pytest.raises(ValueError):
            WorkloadSpec(**{"num_requests": 1, "tokens": TOKENS, "max_model_len": 64, **bad})
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("poetry", spec())
    with pytest.raises(ValueError, match="empty"):
        TokenRange(5, 5)


def test_arrivals_all_at_once_poisson_and_bursty() -> None:
    assert arrival_times(5, math.inf).tolist() == [0.0] * 5
    times = arrival_times(20_000, rate=4.0, burstiness=1.0, seed=3)
    assert times[0] == 0.0 and np.all(np.diff(times) >= 0)
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential gaps
    bursty = np.diff(arrival_times(20_000, rate=4.0, burstiness=0.25, seed=3))
    steady = np.diff(arrival_times(20_000, rate=4.0, burstiness=4.0, seed=3))
    assert bursty.mean() == pytest.approx(0.25, rel=0.05) and steady.mean() == pytest.approx(0.25, rel=0.03)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.1)  # gamma CV = 1 / sqrt(shape)
    assert steady.std() / steady.mean() == pytest.approx(0.5, rel=0.05)
    assert np.array_equal(arrival_times(10, 2.0, seed=1), arrival_times(10, 2.0, seed=1))
    with pytest.raises(ValueError, match="rate"):
        arrival_times(3, 0.0)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_times(3, 1.0, burstiness=-1.0)
    assert parse_rates("1, 2.5,inf") == [1.0, 2.5, math.inf]
    for bad in ("", "1,x", "0", "-2"):
        with pytest.raises(ValueError):
            parse_rates(bad)


# ----------------------------------------------------------------------- trace
def test_trace_parsing_scaling_and_clipping(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens,Extra\n"
        "2023-11-16 18:15:50.6805900,5000,10,a\n"  # out of order on purpose
        "2023-11-16 18:15:46.1805900,100,700,b\n"
        "2023-11-16 18:15:48.1805900,0,20,c\n"
    )
    rows = read_trace(path)
    assert [r.context_tokens for r in rows] == [100, 0, 5000]
    assert rows[2].timestamp - rows[0].timestamp == pytest.approx(4.5)
    workload = trace_workload(
        rows, TOKENS, max_model_len=1024, time_scale=0.5, max_prompt=800, max_output=300
    )
    assert [r.arrival for r in workload.requests] == pytest.approx([0.0, 1.0, 2.25])
    assert [(r.prompt_len, r.max_tokens) for r in workload.requests] == [(100, 300), (1, 20), (800, 10)]
    assert len(trace_workload(rows, TOKENS, 1024, limit=2).requests) == 2
    numeric = tmp_path / "numeric.csv"
    numeric.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n10.5,3,4\n12.0,5,6\n")
    assert [r.arrival for r in trace_workload(read_trace(numeric), TOKENS, 64).requests] == [0.0, 1.5]


def test_bad_traces_raise_precise_errors(tmp_path: Path) -> None:
    missing = tmp_path / "missing.csv"
    missing.write_text("TIMESTAMP,ContextTokens\n1,2\n")
    with pytest.raises(ValueError, match="GeneratedTokens"):
        read_trace(missing)
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,3\nyesterday,2,3\n")
    with pytest.raises(ValueError, match="line 3"):
        read_trace(bad)
    empty = tmp_path / "empty.csv"
    empty.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(ValueError, match="no rows"):
        read_trace(empty)
    with pytest.raises(ValueError, match="time_scale"):
        trace_workload([TraceRow(0.0, 1, 1)], TOKENS, 64, time_scale=0)
    with pytest.raises(ValueError, match="no trace rows"):
        trace_workload([], TOKENS, 64)


# --------------------------------------------------------------------- metrics
def test_request_latencies_from_a_hand_made_timeline() -> None:
    r = RequestRecord(prompt_tokens=10, output_tokens=4, start=1.0, chunk_times=[1.5, 1.6, 1.8, 2.0], end=2.0)
    assert r.ttft == pytest.approx(0.5)
    assert r.e2e == pytest.approx(1.0)
    assert r.tpot == pytest.approx(0.5 / 3)
    assert r.itls == pytest.approx([0.1, 0.2, 0.2])
    # n = 2 samples of 3 tokens: TPOT is per sample
    two = RequestRecord(5, 6, 0.0, [0.2, 0.4, 0.6], 0.6, n=2)
    assert two.tpot == pytest.approx(0.4 / 2)
    single = RequestRecord(5, 1, 0.0, [0.3], 0.3)
    assert single.tpot is None and single.ok


def test_waste_is_taken_when_the_cache_held_the_most_tokens() -> None:
    # vattention keeps finished sequences' pages mapped: its allocation peaks at the end, unused
    timeline = [
        KVSample(0.1, running_seqs=4, allocated_bytes=100, used_bytes=60, units_in_use=10),
        KVSample(0.2, running_seqs=4, allocated_bytes=120, used_bytes=90, units_in_use=12),
        KVSample(0.3, running_seqs=0, allocated_bytes=130, used_bytes=0, units_in_use=13),
    ]
    assert memory_peaks(timeline) == (130, 90, 30)
    assert memory_peaks([]) == (0, 0, 0)


def test_run_metrics_throughput_percentiles_and_goodput() -> None:
    fast = RequestRecord(10, 4, 0.0, [0.1, 0.2, 0.3, 0.4], 0.4)  # TTFT 100 ms, TPOT 100 ms
    slow = RequestRecord(20, 4, 0.0, [1.0, 1.5, 2.0, 2.5], 2.5)  # TTFT 1000 ms, TPOT 500 ms
    failed = RequestRecord(30, 0, 0.0, error="HTTP 500")
    m = compute_metrics([fast, slow, failed], duration_s=2.5, slo=SLO(ttft_ms=500, tpot_ms=200))
    assert (m.completed, m.failed) == (2, 1)
    assert (m.prompt_tokens, m.output_tokens) == (30, 8)
    assert m.output_throughput == pytest.approx(8 / 2.5)
    assert m.total_token_throughput == pytest.approx(38 / 2.5)
    assert m.request_throughput == pytest.approx(2 / 2.5)
    assert m.goodput == pytest.approx(1 / 2.5)  # only `fast` meets both objectives
    assert m.ttft.mean == pytest.approx(550.0) and m.ttft.median == pytest.approx(550.0)
    assert m.ttft.p99 == pytest.approx(np.percentile([100.0, 1000.0], 99))
    assert m.tpot.median == pytest.approx(300.0)
    assert m.itl.count == 6 and m.itl.p90 == pytest.approx(np.percentile([100] * 3 + [500] * 3, 90))
    assert compute_metrics([fast, slow], 2.5).goodput == pytest.approx(2 / 2.5)  # no SLO: all count
    empty = Distribution.of_seconds([])
    assert empty.count == 0 and math.isnan(empty.median)
    with pytest.raises(ValueError, match="duration"):
        compute_metrics([fast], 0.0)


def test_slo_parsing() -> None:
    assert SLO.parse("ttft:2000, tpot:150") == SLO(ttft_ms=2000.0, tpot_ms=150.0)
    assert SLO.parse("e2e:10") == SLO(e2e_ms=10.0)
    for bad in ("ttft", "latency:5", "tpot:fast", "ttft:-1"):
        with pytest.raises(ValueError):
            SLO.parse(bad)


def test_requests_arriving_during_a_run_are_announced_at_their_arrival_time() -> None:
    """The offline driver steps on one thread; a second one tells the engine of each request as
    it arrives (as a server's receiver does), so the cache may back it while a step computes.
    Requests there at the start are added before any step and not announced."""

    class Engine:
        def __init__(self) -> None:
            self.heard: list[tuple[float, tuple[int, ...]]] = []

        def prompts_arrived(self, prompts: list[tuple[tuple[int, ...], str | None]]) -> None:
            self.heard += [(time.perf_counter() - t0, ids) for ids, _ in prompts]

    requests = [BenchRequest((1, 2), 4, 0.0), BenchRequest((3,), 4, 0.05), BenchRequest((4, 5, 6), 4, 0.1)]
    engine, stop = Engine(), threading.Event()
    t0 = time.perf_counter()
    announce_arrivals(engine, requests, [0, 1, 2], t0, stop).join()  # type: ignore[arg-type]
    assert [ids for _, ids in engine.heard] == [(3,), (4, 5, 6)]
    assert engine.heard[0][0] >= 0.05 and engine.heard[1][0] >= 0.1
    engine, t0 = Engine(), time.perf_counter()
    stop.set()  # the run ended first: nothing more is announced
    announce_arrivals(engine, requests, [0, 1, 2], t0, stop).join()  # type: ignore[arg-type]
    assert engine.heard == []


def test_targets_run_interleaved_a_b_a_b() -> None:
    calls = []

    def target(name: str) -> Target:
        def run(workload: Workload) -> RunOutcome:
            calls.append((name, workload.name))
            return RunOutcome([RequestRecord(1, 2, 0.0, [0.1, 0.2], 0.2)], 0.2)

        return Target(name, run)

    workload = Workload("w", (BenchRequest((1,), 2),))
    rounds = [Round(workload, math.inf, repeat) for repeat in range(2)]
    results = run_interleaved([target("A"), target("B")], rounds)
    assert [name for name, _ in calls] == ["A", "B", "A", "B"]
    assert [(r.target, r.repeat) for r in results] == [("A", 0), ("B", 0), ("A", 1), ("B", 1)]
    assert results[0].metrics.output_throughput == pytest.approx(10.0)


# -------------------------------------------------------------------- capacity
def test_capacity_classic_example_paging_holds_about_18x_contiguous() -> None:
    """Sequences of 8 + 90..110 tokens under max_len 2048, 16-token blocks.

    Each needs 7 blocks (98..112 tokens) or 8 (113..118), so paging holds between
    2048 / (16 * 8) = 16 and 2048 / (16 * 7) = 18.3 times as many sequences as reserving
    2048 tokens each; the count itself is checked exactly against the block arithmetic.
    """
    shape = KVShape(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float16)  # 512 B per token
    scenario = CapacityScenario(shape)  # budget: 8 sequences of 2048 tokens = 8 MiB
    results = measure_capacity(scenario, block_size=16, page_sizes=(64 * KIB, 2 * MIB))
    by_name = {r.layout: r for r in results}
    contiguous, paged = results[0], by_name["paged (16-token blocks)"]
    assert contiguous.layout == "contiguous"
    assert contiguous.sequences == 8 and contiguous.allocated_bytes == 8 * MIB
    free_blocks, expected = scenario.budget_bytes // (16 * shape.bytes_per_token), 0
    for prompt, answer in scenario.lengths(1000):
        free_blocks -= -(-(prompt + answer) // 16)
        if free_blocks < 0:
            break
        expected += 1
    assert paged.sequences == expected
    assert 16.0 <= paged.sequences / contiguous.sequences <= 2048 / 112
    assert paged.allocated_bytes - paged.used_bytes < paged.sequences * 16 * shape.bytes_per_token
    # vattention rounds up to pages. At 64 KiB, token-major: a page holds 512 of this shape's
    # 128-byte K (or V) rows, so a sequence takes one page in each of 2 layers x K, V = 256 KiB;
    # head-major: one page per KV head column, twice that.
    assert by_name["vattention (64 KiB pages, token-major)"].sequences == 8 * MIB // (4 * 64 * KIB) == 32
    assert by_name["vattention (64 KiB pages, head-major)"].sequences == 8 * MIB // (8 * 64 * KIB) == 16
    # At 2 MiB a token-major sequence takes 4 x 2 MiB: fewer sequences than contiguous reservation;
    # head-major's 8 x 2 MiB exceeds the whole budget.
    assert by_name["vattention (2 MiB pages, token-major)"].sequences == 1
    assert by_name["vattention (2 MiB pages, head-major)"].sequences == 0
    # layer-packed: one region a sequence, 512 B a token. 64 KiB pages hold 128 tokens: one page
    # for 98..118; 2 MiB pages hold 4,096 tokens: four sequences in a budget of four pages.
    assert by_name["vattention (64 KiB pages, layer-packed)"].sequences == 8 * MIB // (64 * KIB) == 128
    assert by_name["vattention (2 MiB pages, layer-packed)"].sequences == 4


# ---------------------------------------------------------------------- kernels
def test_kernel_matrix_on_a_tiny_shape() -> None:
    shape = AttentionShape(num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, block_size=16)
    matrix = kernel_matrix(shape, contexts=(32, 100), batches=(1, 3), min_seconds=0.0)
    keys = {"B=1 L=32", "B=1 L=100", "B=3 L=32", "B=3 L=100"}
    math_virtual = matrix.cell("sdpa math", VIRTUAL)
    assert math_virtual.status == UNMODIFIED and math_virtual.max_error < 1e-5
    assert set(math_virtual.times_ms) == keys and all(t > 0 for t in math_virtual.times_ms.values())
    assert matrix.cell("sdpa math", PAGED).status == GATHER
    packed = matrix.cell("sdpa math", PACKED)  # one layer's views over tokens of 30 layers
    assert packed.status == UNMODIFIED and packed.max_error < 1e-5 and set(packed.times_ms) == keys
    # the paged torch path views its blocks as one contiguous pool: packed blocks are strided
    assert matrix.cell("vmkv paged: gather + sdpa", PACKED).status == DOES_NOT_RUN
    for layout in (VIRTUAL, PAGED):
        cell = matrix.cell("vmkv paged: gather + sdpa", layout)
        assert cell.status == BLOCK_TABLE and cell.max_error < 1e-5 and set(cell.times_ms) == keys
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        assert matrix.cell("flash-attn", VIRTUAL).status == NOT_INSTALLED
    for cell in matrix.cells:  # whatever ran was right
        if cell.max_error is not None:
            assert cell.max_error < 1e-4, cell


def test_a_kernel_returning_garbage_reads_wrong_result_not_runs() -> None:
    shape = AttentionShape(num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, block_size=16)
    kernels = [
        Kernel("garbage", dense=lambda q, k, v, lens, scale: torch.zeros_like(q)),
        Kernel(
            "off by a little",
            dense=lambda q, k, v, lens, scale: (
                reference_attention(q, k[:, : lens[0]], v[:, : lens[0]], scale) + 1e-3
            ),
        ),
    ]
    matrix = kernel_matrix(shape, contexts=(32,), batches=(2,), kernels=kernels, min_seconds=0.0)
    for name in ("garbage", "off by a little"):
        cell = matrix.cell(name, VIRTUAL)
        assert cell.status == WRONG_RESULT and cell.max_error > max_error_allowed(torch.float32), cell


# --------------------------------------------------------------------- client
def fake_openai_server() -> FastAPI:
    """Streams 3 chunks 50 ms apart after a 100 ms wait, then usage, as an OpenAI server does."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.get("/metrics")
    async def metrics() -> StreamingResponse:
        return StreamingResponse(iter(["# TYPE x counter\nfake:requests_total 7\n"]), media_type="text/plain")

    @app.post("/v1/completions")
    async def completions(body: dict) -> StreamingResponse:
        assert body["model"] == "fake-model" and body["stream"] and body["ignore_eos"]

        async def events():  # noqa: ANN202
            await asyncio.sleep(0.1)
            for i in range(3):
                chunk = {"choices": [{"index": 0, "text": f"t{i}"}]}
                yield f"data: {json.dumps(chunk)}\n\n"
                await asyncio.sleep(0.05)
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": 3, "total_tokens": 0}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_streaming_client_measures_ttft_itl_and_counts_usage() -> None:
    server = uvicorn.Server(uvicorn.Config(fake_openai_server(), host="127.0.0.1", port=0, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        workload = Workload("w", (BenchRequest((1, 2, 3), 3), BenchRequest((4, 5), 3, arrival=0.2)))
        outcome = run_online(f"http://127.0.0.1:{port}", workload)
    finally:
        server.should_exit = True
        thread.join(5)
    first, second = outcome.records
    assert first.ok and second.ok
    assert (first.prompt_tokens, first.output_tokens, second.prompt_tokens) == (3, 3, 2)
    assert 0.1 <= first.ttft < 0.6
    assert all(0.04 <= gap < 0.5 for gap in first.itls) and len(first.itls) == 2
    assert second.start >= 0.2  # sent at its arrival time
    assert outcome.server_metrics == {"fake:requests_total": 0.0}
    assert outcome.duration_s >= second.end


def test_prometheus_parsing_and_peer_urls() -> None:
    text = (
        '# HELP a x\nvmkv:a_total{model="m"} 3\nvmkv:a_total{model="n"} 2\n'
        'vmkv:h_bucket{le="1"} 5\nvmkv:h_sum 1.5\nvmkv:g NaN\n'
    )
    assert parse_prometheus(text) == {"vmkv:a_total": 5.0, "vmkv:h_sum": 1.5}
    assert parse_peer_urls(["peer=http://127.0.0.1:8001/"]) == [("peer", "http://127.0.0.1:8001")]
    with pytest.raises(ValueError, match="NAME=http"):
        parse_peer_urls(["127.0.0.1:8001"])


# ----------------------------------------------------------------- end to end


def test_tiny_offline_bench_writes_json_markdown_and_plots(
    tiny_model_dir: Path, tmp_path: Path, one_torch_thread: None
) -> None:
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    out = tmp_path / "out"
    args = parser.parse_args(
        [
            "--model",
            str(tiny_model_dir),
            "--out",
            str(out),
            "--sections",
            "capacity,offline",
            "--modes",
            "vattention,paged",
            "--num-requests",
            "4",
            "--repeats",
            "1",
            "--rates",
            "50,inf",
            "--kv-budget-mib",
            "16",
            "--max-model-len",
            "256",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "256",
        ]
    )
    bench_main(args)
    results = json.loads((out / "results.json").read_text())
    runs = results["offline"]
    assert [(r["target"], r["rate"]) for r in runs] == [
        (t, rate) for rate in (50.0, "inf") for t in ("vattention", "paged", "transformers")
    ]
    for run in runs:
        assert run["metrics"]["completed"] == 4 and run["metrics"]["failed"] == 0
        assert run["metrics"]["output_throughput"] > 0
    engine_runs = [r for r in runs if r["engine"]]
    assert {r["target"] for r in engine_runs} == {"vattention", "paged"}
    assert all(r["engine"]["timeline"] and r["engine"]["peak_allocated_bytes"] > 0 for r in engine_runs)
    # the mapper's CPU is vattention's alone: a share of step time there, absent for paged
    shares = {r["target"]: r["engine"]["mapper_share"] for r in engine_runs}
    assert shares["vattention"] >= 0 and shares["paged"] is None
    assert results["capacity"][0]["layout"] == "contiguous"
    speeds = {(r["order"], r["attention"]) for r in results["decode_speed"]}
    assert speeds == {(o, a) for o in ("token", "head", "packed") for a in ("cpu_kernel", "sdpa")}
    assert all(r["ms_per_layer"] > 0 for r in results["decode_speed"])
    report = (out / "report.md").read_text()
    assert "| vattention |" in report and "| transformers |" in report and "Capacity" in report
    assert "Decode attention per vattention order" in report and "mapper CPU / step time" in report
    pngs = sorted(p.name for p in (out / "plots").glob("*.png"))
    assert {"capacity.png", "kv_memory.png", "rate_sweep.png", "ttft_cdf.png"} <= set(pngs)
    assert all((out / "plots" / p).stat().st_size > 1000 for p in pngs)


def test_transformers_peer_runs_parallel_samples(tiny_model_dir: Path, one_torch_thread: None) -> None:
    """n > 1: every sample of the warm-up and of each request is accounted to its own request."""
    config = EngineConfig(
        model=str(tiny_model_dir), dtype="float32", kv_budget_bytes=1 << 22, max_model_len=256
    )
    spec = WorkloadSpec(
        num_requests=3, tokens=TokenRange(3, 300), max_model_len=256, max_prompt=32, max_output=6
    )
    workload = make_workload("parallel", spec)
    outcome = transformers_target(config).run(workload)
    assert [r.error for r in outcome.records] == [None] * 3
    assert [r.output_tokens for r in outcome.records] == [r.max_tokens * r.n for r in workload.requests]
