"""Resident memory after an overload: the engine gives the C heap's free pages back to the OS each
time its last request leaves (finished, failed or aborted) and, while requests keep arriving,
at most once every BUSY_TRIM_SECONDS after a step; resident memory returns near where it was
before the burst. Between trims the heap keeps step-sized buffers for reuse."""

from __future__ import annotations

import os
import resource
from pathlib import Path

import pytest
import torch

from vmkv import heap
from vmkv.engine import LLM, SamplingParams
from vmkv.heap import keep_step_buffers, trim_heap

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_the_heap_is_trimmed_once_when_the_last_request_leaves(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trims = []
    monkeypatch.setattr(heap, "trim_heap", lambda: trims.append(1))
    llm = LLM(
        str(tiny_model_dir), kv_mode="paged", dtype="float32", kv_budget_bytes=1 << 22, max_model_len=128
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate([[5, 6, 7]] * 6, params)
    assert trims == [1]  # six requests, one trim: when the last one finished
    llm.engine.add_request("a", [5, 6, 7], params)
    llm.engine.abort_request("a")
    assert trims == [1, 1]  # an abort that empties the engine trims too
    llm.close()


def test_a_busy_engine_trims_between_steps_at_most_once_per_interval(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a steady load the engine never empties; the soak's plateau after a burst was the
    heap's free memory, kept until then."""
    trims: list[int] = []
    monkeypatch.setattr(heap, "trim_heap", lambda: trims.append(1))
    monkeypatch.setattr(heap, "BUSY_TRIM_SECONDS", 0.0)
    llm = LLM(
        str(tiny_model_dir), kv_mode="paged", dtype="float32", kv_budget_bytes=1 << 22, max_model_len=128
    )
    engine, params = llm.engine, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)
    busy_steps = busy_trims = 0
    while engine.has_unfinished_requests():  # a new request each step: the engine never empties
        trimmed = len(trims)
        engine.step()
        if engine.num_steps < 6:
            engine.add_request(f"r{engine.num_steps}", [5, 6, 7], params)
        if engine.has_unfinished_requests():
            busy_steps, busy_trims = busy_steps + 1, busy_trims + len(trims) - trimmed
    assert busy_steps >= 6 and busy_trims == busy_steps, (busy_steps, busy_trims)
    llm.close()
    monkeypatch.setattr(heap, "BUSY_TRIM_SECONDS", 3600.0)
    llm = LLM(
        str(tiny_model_dir), kv_mode="paged", dtype="float32", kv_budget_bytes=1 << 22, max_model_len=128
    )
    trims.clear()
    llm.generate([[5, 6, 7]] * 6, params)
    assert trims == [1]  # within the interval: only the trim when the engine emptied
    llm.close()


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads /proc")
def test_resident_memory_returns_after_a_burst_of_large_buffers() -> None:
    """What an overload leaves in glibc's arenas: many mid-sized blocks (below the mmap
    threshold) freed out of order stay resident until trimmed."""
    before = rss_mib()
    blocks = [bytearray(100_000) for _ in range(3000)]  # ~300 MB of 100 kB allocations
    del blocks[:-1]  # the last one pins the top of the arena, as a live request's buffer would
    held = rss_mib()
    assert trim_heap()
    after = rss_mib()
    assert held - before > 200 and after - before < 50, (before, held, after)


def test_step_sized_buffers_are_reused_without_faulting_in_again() -> None:
    """A [64, 49,152] fp32 tensor (a batch-64 step's logits) allocated, written and freed again
    and again: from the heap its pages stay mapped; as fresh mappings each would fault in ~3,000
    pages."""
    if not keep_step_buffers():
        pytest.skip("needs glibc's mallopt")
    for _ in range(2):  # the heap grows to hold one
        torch.empty(64, 49152).fill_(1.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        torch.empty(64, 49152).fill_(1.0)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    # fresh mappings: ~30,000; from the heap at most an occasional refault of one (3,072 pages,
    # seen once in a few runs after the trim of the test before)
    assert faults < 8000, faults
