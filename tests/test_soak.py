"""A few seconds of the soak run (benchmarks/soak.py runs it for minutes) in every KV mode:
`vmkv serve` over real HTTP at a steady rate, with clients hanging up part way and stop
strings ending requests early, and an overload of 24 of the longest requests at once two
seconds in. Nothing fails, every KV byte is freed once idle, and neither process's resident
memory nor the layout's units creep up, the burst included: resident memory over the last
third is within 16 MiB of what it was just before the burst."""

from __future__ import annotations

from pathlib import Path

import pytest

from vmkv.bench.soak import Sample, SoakConfig, SoakResult, is_error_event, run_soak
from vmkv.engine.config import KV_MODES


@pytest.mark.parametrize("kv_mode", KV_MODES)
def test_a_short_soak_completes_everything_and_frees_everything(tiny_model_dir: Path, kv_mode: str) -> None:
    result = run_soak(
        SoakConfig(model=str(tiny_model_dir), kv_mode=kv_mode, seconds=6, rate=5, sample_every=0.5, burst=24)
    )
    assert not result.failed, result.failed[:3]
    assert result.completed >= 15 + 24 and result.disconnected >= 1, result.summary()
    assert result.idle["vllm:num_requests_running"] == 0 and result.leaked_bytes == 0, result.summary()
    assert result.idle["vmkv:kv_cache_allocated_bytes"] <= max(s.kv_allocated_bytes for s in result.samples)
    for process in ("server_rss_mib", "engine_rss_mib"):
        assert result.growth(process) < 16, result.summary()
        before, _, after = result.around_burst(process)  # came back after the burst
        assert after - before < 16, result.summary()


def test_only_an_error_object_counts_as_a_failed_stream() -> None:
    """A completion whose text is the word "error" once failed a healthy request in the soak."""
    text = '{"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": "error"}]}'
    failure = '{"error": {"message": "the engine died", "type": "server_error", "param": null, "code": 503}}'
    assert not is_error_event(f"data: {text}")
    assert is_error_event(f"data: {failure}")
    assert is_error_event("data: {truncated")  # a stream no client could read is a failure too
    assert not is_error_event("data: [DONE]")
    assert not is_error_event("")


def test_engine_growth_is_judged_beyond_the_pages_the_cache_mapped() -> None:
    """vattention keeps freed pages mapped for reuse: RSS that grows with its mapped pages is the
    cache's, RSS beyond them is not. 60 samples; from the middle on the engine holds 40 MiB
    more, of which 32 MiB are 512 more mapped pages of 64 KiB."""
    page = 64 << 10
    samples = [
        Sample(
            t=float(i),
            server_rss_mib=500.0,
            engine_rss_mib=1000.0 + (40.0 if i >= 30 else 0.0),
            kv_allocated_bytes=(100 + (512 if i >= 30 else 0)) * page,
            kv_units_in_use=100 + (512 if i >= 30 else 0),
            kv_pages_mapped=100 + (512 if i >= 30 else 0),
            running=1.0,
            waiting=0.0,
        )
        for i in range(60)
    ]
    result = SoakResult(SoakConfig(model="m", kv_mode="vattention"), samples=samples)
    assert result.growth("engine_rss_mib") == 40.0
    assert result.engine_growth_beyond_mappings() == 8.0
