"""Fault injection under load, offline, in every KV mode: a driver whose map calls fail as if out
of memory and are slow (vattention, the layout that maps), model forwards that raise, one
request's sampler failing. The requests at fault fail with a clear error or are retried; every
other request gives exactly the output of a run without faults; the allocator's self-check holds
after every step; afterwards nothing is held."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest

from vmkv import faults
from vmkv.engine import LLM, SamplingParams, kv_factory
from vmkv.engine.config import KV_MODES
from vmkv.faults import Faults, InvariantError, check_engine
from vmkv.vattention import VAttentionKVCache

pytestmark = pytest.mark.usefixtures("one_torch_thread")

POISON = 7  # a token id: sampling any prompt that holds it raises
MAX_TOKENS = 12
# Tiny model, fp32: 512 B of KV per token. 48 KiB holds 96 tokens, far fewer than the requests
# need together, so vattention (4 KiB pages) and paged (16-token blocks) preempt.
SMALL_BUDGET = 48 * 1024
VATTENTION_BUDGET = 160 * 1024  # five 64-token slots' page sets


def make_llm(model_dir: Path, kv_mode: str, **options: object) -> LLM:
    budget = {"vattention": VATTENTION_BUDGET, "paged": SMALL_BUDGET, "contiguous": 1 << 16}[kv_mode]
    return LLM(
        str(model_dir),
        kv_mode=kv_mode,
        dtype="float32",
        kv_budget_bytes=budget,
        max_model_len=64,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        page_size=4096,
        **options,
    )


def workload(count: int = 10, seed: int = 0) -> tuple[list[list[int]], set[int]]:
    """Token-id prompts of 5..40 tokens without POISON, and the indices given one in the middle."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(8, 200) for _ in range(rng.randrange(5, 40))] for _ in range(count)]
    poisoned = {1, 6}
    for i in poisoned:
        prompts[i][len(prompts[i]) // 2] = POISON
    return prompts, poisoned


def test_the_spec_parses_and_unknown_faults_are_refused() -> None:
    parsed = Faults.parse("map_enomem_every=3, map_delay_ms=0.5,forward_fail_every=9,check_invariants=1")
    assert (parsed.map_enomem_every, parsed.map_delay_ms, parsed.forward_fail_every) == (3, 0.5, 9)
    assert parsed.check_invariants and parsed.sample_poison_token == -1
    with pytest.raises(ValueError, match="unknown fault 'map_fail'"):
        Faults.parse("map_fail=1")
    assert faults.active() is None  # off unless asked for: production paths see None


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
@pytest.mark.parametrize("kv_mode", KV_MODES)
def test_under_faults_only_the_requests_at_fault_fail_and_nothing_leaks(
    tiny_model_dir: Path, kv_mode: str, speculative: bool
) -> None:
    """With speculative decoding too: a draft's room is taken when the map fails, verification
    samples the poisoned rows, and a failed forward drops a step with drafts; each request still
    gets the tokens of a clean run without speculation, or fails alone."""
    prompts, poisoned = workload()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    clean = make_llm(tiny_model_dir, kv_mode)
    expected = [o.outputs[0].token_ids for o in clean.generate(prompts, params)]
    clean.close()

    maps = {"map_enomem_every": 11, "map_delay_ms": 0.2} if kv_mode == "vattention" else {}
    injected = Faults(forward_fail_every=9, sample_poison_token=POISON, check_invariants=True, **maps)
    spec = {"num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    with faults.install(injected):
        llm = make_llm(tiny_model_dir, kv_mode, speculative_config=spec if speculative else None)
    outputs = llm.generate(prompts, params)
    stats = llm.engine.stats()
    check_engine(llm.engine)
    llm.close()

    for i, out in enumerate(outputs):
        sample = out.outputs[0]
        if i in poisoned:
            assert sample.finish_reason == "error" and "injected fault" in out.error, out
        else:
            assert (sample.finish_reason, sample.token_ids) == ("length", expected[i]), (i, out.error)
    assert injected.injected["sample"] >= len(poisoned)
    assert injected.injected["forward"] >= 2  # each retried: the requests in it still completed
    if kv_mode == "vattention":
        assert injected.injected["map_enomem"] >= 1
    assert stats.memory.used_bytes == 0 and stats.num_running_seqs == 0
    assert (stats.spec_draft_tokens > 0) == speculative
    assert not llm.engine.cache.seqs and stats.free_tokens == llm.engine.info.capacity_tokens


def test_a_forward_that_keeps_failing_fails_its_requests_with_the_reason(tiny_model_dir: Path) -> None:
    with faults.install(Faults(forward_fail_every=1, check_invariants=True)):
        llm = make_llm(tiny_model_dir, "paged")
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert out.outputs[0].finish_reason == "error"
    assert "the model forward failed 2 times" in out.error and "injected fault" in out.error
    assert llm.engine.stats().memory.used_bytes == 0
    llm.close()


def test_the_self_check_catches_a_leaked_sequence(tiny_model_dir: Path) -> None:
    llm = make_llm(tiny_model_dir, "paged")
    check_engine(llm.engine)
    llm.engine.cache.admit(999, [5, 6, 7])  # KV no request owns: a leak
    with pytest.raises(InvariantError, match="no live request owns"):
        check_engine(llm.engine)
    llm.close()


def test_a_transient_enomem_while_alone_is_retried_not_failed(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ENOMEM from the driver (the machine short of memory for a moment) while a request runs
    alone is retried on the next steps and the request completes, with the output it has
    without faults; it used to fail as needing more KV memory than the whole cache holds.
    With every 9th map call failing and 8 per page set here (head-major: one per KV head of each
    layer's K and V; no idle slots pre-mapped), a first engine's request takes calls 1-8; a
    second engine's lone request then has its first map (call 9) fail and its retry (calls
    10-17) succeed."""
    head_major = functools.partial(VAttentionKVCache, order="head", premap_slots=0)
    monkeypatch.setattr(kv_factory, "VAttentionKVCache", head_major)
    prompt = list(range(8, 48))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    clean = make_llm(tiny_model_dir, "vattention")
    (expected,) = clean.generate([prompt], params)
    clean.close()
    with faults.install(Faults(map_enomem_every=9, check_invariants=True)) as injected:
        outputs = []
        for _ in range(2):
            llm = make_llm(tiny_model_dir, "vattention")
            outputs += llm.generate([prompt], params)
            llm.close()
    assert injected.injected == {"map_enomem": 1}
    for output in outputs:
        assert output.error is None and output.outputs[0].token_ids == expected.outputs[0].token_ids
