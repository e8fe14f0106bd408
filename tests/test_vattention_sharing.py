"""Sharing in vattention: prefix hits map cached physical pages into the new sequence's own
virtual range, a write never lands in a shared page (copy-on-write), salts and models never
share, hits are verified against token ids, cached chunks are evicted least recently used, and
kept pages go back after their idle time. The engine's greedy outputs are the same with sharing
on and off, and the same as paged mode's."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from vmkv.drivers import HostDriver

from vmkv import LLM, SamplingParams, prefix_cache
from vmkv.engine import kv_factory
from vmkv.kv_cache import KVShape, OutOfKVMemory, SeqStep, StepBatch, UpcomingPrompt
from vmkv.vattention import VAttentionKVCache
from vmkv.vattention import cache as vattention_cache
from vmkv.vattention.geometry import SlotGeometry
from vmkv.vattention.prefix import chunk_pages

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)  # 128 B a token a tensor
PAGE = 4096  # token-major: 32 tokens a page, one page a chunk
UNITS = 2 * SHAPE.num_layers

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_cache(sets: int = 8, **options: object) -> VAttentionKVCache:
    opts = {
        "page_size": PAGE,
        "order": "token",
        "background_mapping": False,
        "prefix_caching": True,
        "kept_idle_seconds": None,
        "pressure_min_available": 0.0,
    } | options
    budget = None if "driver" in opts else sets * UNITS * PAGE
    return VAttentionKVCache(SHAPE, 128, budget, model_id="m", **opts)  # type: ignore[arg-type]


def compute(cache: VAttentionKVCache, seq_id: int, start: int, end: int, seed: int) -> None:
    """One step writing random K/V for tokens start..end-1 of the sequence (two query heads
    per KV head, whatever the cache's shape)."""
    gen = torch.Generator().manual_seed(seed)
    shape = cache.shape
    plan = cache.prepare(StepBatch.build([SeqStep(seq_id, start, end - start)]))
    for layer in range(shape.num_layers):
        k, v = (torch.randn(end - start, shape.num_kv_heads, shape.head_dim, generator=gen) for _ in range(2))
        q = torch.randn(end - start, 2 * shape.num_kv_heads, shape.head_dim, generator=gen)
        cache.attend(layer, q, k, v, plan, 0.25)
    cache.finish_step(plan)


def keys(cache: VAttentionKVCache, seq_id: int, n: int) -> torch.Tensor:
    return cache.mapping.k[0][cache.seqs[seq_id].slot, :n].clone()


def test_a_hit_maps_the_same_physical_pages_and_computes_only_the_rest() -> None:
    cache = make_cache()
    prompt = list(range(1, 81))
    assert cache.admit(0, prompt) == 0
    compute(cache, 0, 0, 80, seed=0)
    assert cache.admit(1, prompt[:70] + [999]) == 64  # two whole chunks of 32
    a, b = (cache.table.slots[cache.seqs[i].slot].sets for i in (0, 1))
    assert a[:2] == b[:2] and not set(a[2:]) & set(b[2:])
    torch.testing.assert_close(keys(cache, 1, 64), keys(cache, 0, 64), rtol=0, atol=0)
    stats = cache.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (80 + 71, 64)
    assert stats.shared_pages == 2 * UNITS and stats.bytes_saved == 2 * UNITS * PAGE
    compute(cache, 1, 64, 71, seed=1)  # writes past the shared pages only
    torch.testing.assert_close(keys(cache, 1, 64), keys(cache, 0, 64), rtol=0, atol=0)
    cache.free(0)
    cache.free(1)
    assert cache.stats().units_kept == cache.stats().units_in_use  # only cached chunks are left
    cache.close()


def test_a_prompt_cached_whole_copies_the_page_its_last_token_writes() -> None:
    cache = make_cache()
    prompt = list(range(1, 65))
    cache.admit(0, prompt)
    compute(cache, 0, 0, 64, seed=0)
    before = keys(cache, 0, 64)
    assert cache.admit(1, prompt) == 63  # the last token is always computed
    assert cache.stats().cow_copies == UNITS  # one page in every tensor, then remapped
    a, b = (cache.table.slots[cache.seqs[i].slot].sets for i in (0, 1))
    assert a[0] == b[0] and a[1] != b[1]
    torch.testing.assert_close(keys(cache, 1, 64), before, rtol=0, atol=0)  # the copy has the data
    compute(cache, 1, 63, 64, seed=5)
    torch.testing.assert_close(keys(cache, 0, 64), before, rtol=0, atol=0)  # the original is untouched
    cache.close()


def test_a_step_never_writes_into_a_shared_page() -> None:
    cache = make_cache()
    cache.admit(0, list(range(1, 41)))
    compute(cache, 0, 0, 40, seed=0)
    with pytest.raises(ValueError, match="shared page"):
        cache.prepare(StepBatch.build([SeqStep(0, 10, 30)]))  # page 0 is indexed: it is shared
    cache.close()


def test_salts_and_models_never_share() -> None:
    cache = make_cache()
    prompt = list(range(1, 41))
    cache.admit(0, prompt, cache_salt="a")
    compute(cache, 0, 0, 40, seed=0)
    assert cache.admit(1, prompt, cache_salt="b") == 0
    assert cache.admit(2, prompt) == 0
    assert cache.admit(3, prompt, cache_salt="a") == 32
    assert cache.seqs[3].identity == ("m", "a")  # the model's identity keys every chunk too
    cache.close()


def test_a_forced_hash_collision_is_detected_and_never_shared(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefix_cache, "hash_block", lambda parent, tokens, identity: 42)
    cache = make_cache()
    cache.admit(0, list(range(1, 41)))
    compute(cache, 0, 0, 40, seed=0)
    assert cache.admit(1, list(range(2, 42))) == 0  # same hash, other tokens: a miss
    assert cache.stats().hash_collisions == 1
    cache.close()


def test_cached_chunks_are_evicted_least_recently_used_first() -> None:
    cache = make_cache(sets=5)
    prompts = [[p] * 40 for p in (1, 2, 3)]
    for i, prompt in enumerate(prompts):
        cache.admit(i, prompt)
        compute(cache, i, 0, 40, seed=i)
        cache.free(i)
    assert len(cache.prefix.chunks) == 3
    assert cache.admit(10, prompts[0]) == 32  # prompt 0 is used again: now the most recent
    cache.free(10)
    cache.admit(11, [9] * 128)  # needs 4 of the 5 sets: two chunks must go, the oldest first
    assert cache.stats().prefix_cache_evictions == 2
    cache.free(11)
    assert cache.admit(12, prompts[0]) == 32
    assert cache.admit(13, prompts[2]) == 0
    cache.close()


def test_a_fork_shares_written_pages_and_copies_the_partly_filled_last_one() -> None:
    cache = make_cache()
    cache.admit(0, list(range(1, 41)))
    compute(cache, 0, 0, 40, seed=0)
    cache.fork(0, 1)
    a, b = (cache.table.slots[cache.seqs[i].slot].sets for i in (0, 1))
    assert a[0] == b[0] and a[1] != b[1]
    assert cache.pool.refcount[a[0]] == 3  # two slots and the prefix index
    torch.testing.assert_close(keys(cache, 1, 40), keys(cache, 0, 40), rtol=0, atol=0)
    cache.close()


def test_kept_pages_beyond_the_watermark_go_back_after_their_idle_time() -> None:
    cache = make_cache(kept_watermark=0.25, kept_idle_seconds=0.0)  # 2 of 8 sets may stay
    for i in range(3):
        cache.admit(i, [i + 1] * 60)
        compute(cache, i, 0, 60, seed=i)
    for i in range(3):
        cache.free(i)
    assert cache.stats().units_kept == 6 * UNITS  # idle slots keep a cached chunk and a private page each
    assert cache.trim() == 4  # unmapped: the private pages, and the least recently used chunk evicted
    stats = cache.stats()
    assert stats.units_kept == 2 * UNITS and stats.page_sets_trimmed == 4
    assert stats.pages_returned > 0 and cache.driver.stats.pages_punched == stats.pages_returned
    assert cache.admit(9, [3] * 60) == 32  # the most recent chunk stayed
    cache.close()


def test_deferred_reclamation_keeps_idle_slots_until_the_trim() -> None:
    cache = make_cache(prefix_caching=False, kept_watermark=0.0, kept_idle_seconds=3600.0)
    cache.admit(0, [1] * 100)
    cache.free(0)
    assert cache.stats().units_kept == 4 * UNITS and cache.trim() == 0  # not idle long enough
    assert cache.trim(force=True) == 4 and cache.stats().units_kept == 0
    cache.close()


def test_a_forced_trim_frees_every_kept_page_of_a_slot_sharing_one_with_a_running_sequence() -> None:
    """An idle slot may keep a set a running sequence maps behind private ones (the replicated
    lifecycle test reached it through prefix hits and swaps). Dropping that set frees nothing:
    the trim must not count it toward what it frees, or the private set before it stays."""
    cache = make_cache(prefix_caching=False, kept_watermark=0.0)
    cache.admit(0, [1] * 100)  # four page sets
    compute(cache, 0, 0, 100, seed=0)
    table = cache.table
    kept = table.slots[cache.seqs[0].slot]
    shared = kept.sets[2]
    cache.admit(1, [2] * 10)
    running = table.slots[cache.seqs[1].slot]
    table.mapping.drop_pages(running, 0)
    table.map_cached(running, [shared])  # the running sequence's first page is the kept slot's third
    cache.free(0)
    assert table.kept() == 3
    assert cache.trim(force=True) == 3
    assert table.kept() == 0 and kept.sets == [] and running.sets == [shared]
    cache.close()


@pytest.mark.parametrize(
    ("order", "pages", "tokens"), [("token", 3, 512), ("head", 1, 512), ("packed", 6, 17)]
)
def test_chunk_granularity_at_the_default_page_size(order: str, pages: int, tokens: int) -> None:
    """SmolLM2-135M in bf16: 384 B a token token-major (pages end mid-token), 128 B a head,
    23,040 B packed (a chunk ending on a token boundary would be 45 pages: 16 tokens instead)."""
    smollm = KVShape(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    geo = SlotGeometry(smollm, 2048, 1, 64 * 1024, order)
    assert chunk_pages(geo) == pages
    assert pages * geo.page_size // geo.column_token_bytes == tokens


PACKED_SHAPE = KVShape(num_layers=3, num_kv_heads=1, head_dim=16, dtype=torch.float32)  # 384 B a token


def make_packed_cache() -> VAttentionKVCache:
    """Layer-packed, 32 pages: 10.67 tokens a page, so chunks (2 pages) end mid-token."""
    return VAttentionKVCache(
        PACKED_SHAPE,
        128,
        32 * PAGE,
        page_size=PAGE,
        order="packed",
        background_mapping=False,
        prefix_caching=True,
        kept_idle_seconds=None,
        pressure_min_available=0.0,
        model_id="m",
    )


def test_a_packed_hit_ending_mid_token_reuses_whole_tokens_and_copies_the_last_page() -> None:
    """384 B packed tokens (3 layers, one 16-wide head, fp32): 10.67 a 4 KiB page, a chunk is 2
    pages whose key covers the token straddling its end; a hit on two chunks reuses the 42
    tokens wholly inside them and copies page 3, where token 42 is rewritten."""
    cache = make_packed_cache()
    assert (cache.prefix.pages, cache.prefix.end(0), cache.prefix.whole(2)) == (2, 22, 42)

    def kv(seq_id: int, n: int) -> list[torch.Tensor]:
        return [view[cache.seqs[seq_id].slot, :n].clone() for view in cache.mapping.tensors()]

    prompt = list(range(1, 81))
    cache.admit(0, prompt)
    compute(cache, 0, 0, 80, seed=0)
    before = kv(0, 80)
    assert cache.admit(1, prompt[:50] + [999] * 10) == 42
    a, b = (cache.table.slots[cache.seqs[i].slot].sets for i in (0, 1))
    assert a[:3] == b[:3] and a[3] != b[3] and cache.stats().cow_copies == 1
    for x, y in zip(kv(1, 42), before, strict=True):
        torch.testing.assert_close(x, y[:42], rtol=0, atol=0)
    compute(cache, 1, 42, 60, seed=1)
    for x, y in zip(kv(0, 80), before, strict=True):  # the original is untouched
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    cache.close()


def test_every_page_counted_available_can_be_reclaimed_after_a_packed_hit() -> None:
    """A hit that copied its last page on write leaves that chunk's first pages mapped by the new
    sequence and its last page held by the index alone. The cache counts that page available,
    so filling the cache must be able to evict the chunk for it: admissions succeed until
    OutOfKVMemory, never with the pool short of what was promised (it raised ValueError)."""
    cache = make_packed_cache()
    prompt = list(range(1, 81))
    cache.admit(0, prompt)
    compute(cache, 0, 0, 80, seed=0)
    assert cache.admit(1, prompt[:50] + [999] * 10) == 42  # page 3 copied on write
    cache.free(0)  # its slot keeps its pages; the chunks stay indexed
    promised = cache.table.available()
    taken, seq_id = 0, 2
    with pytest.raises(OutOfKVMemory):
        while True:
            cache.admit(seq_id, [seq_id * 1000 + i for i in range(10)])  # one page each, no hit
            taken += 1
            seq_id += 1
    assert taken == promised  # every page promised was found, the chunk's last one included
    cache.close()


# ------------------------------------------------------------------------------ the engine
def engine(model_dir: Path, kv_mode: str, prefix: bool, **options: object) -> LLM:
    settings = {"kv_budget_bytes": 1 << 22} | options
    return LLM(
        str(model_dir),
        kv_mode=kv_mode,
        dtype="float32",
        max_model_len=384,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        page_size=4096,
        block_size=16,
        enable_prefix_caching=prefix,
        **settings,
    )


def test_engine_outputs_are_identical_with_sharing_on_and_off_and_to_paged(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shared ~200-token prefix (three requests, the later ones admitted after the first
    finished, so they hit) and n = 4 samples of one prompt, greedy, fp32; vattention in the
    per-layer token-major order and in the layer-packed one."""
    prefix = [(7 * i) % 300 + 3 for i in range(200)]
    prompts = [prefix + [11, 12, 13], prefix + [21, 22], prefix[:150] + [31]]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    samples = SamplingParams(n=4, temperature=0.0, max_tokens=12, ignore_eos=True)
    results = {}
    for name, kv_mode, on in [
        ("on", "vattention", True),
        ("off", "vattention", False),
        ("packed", "vattention", True),
        ("paged", "paged", True),
    ]:
        order = "packed" if name == "packed" else "token"
        monkeypatch.setattr(
            kv_factory, "VAttentionKVCache", functools.partial(VAttentionKVCache, order=order)
        )
        llm = engine(tiny_model_dir, kv_mode, on)
        if kv_mode == "vattention":
            assert llm.engine.cache.geometry.order == order
        first = llm.generate(prompts[0], greedy)[0].outputs[0].token_ids
        rest = [o.outputs[0].token_ids for o in llm.generate(prompts[1:], greedy)]
        forked = [o.token_ids for o in llm.generate(prompts[1], samples)[0].outputs]
        stats = llm.engine.cache.stats()
        results[name] = ([first, *rest], forked)
        if name in ("on", "packed"):
            assert stats.prefix_cache_hits >= 2 * 192  # the later requests found the prefix
            assert stats.fork_shared_pages > 0
        if name == "off":
            assert stats.prefix_cache_hits == 0
        llm.close()
    assert results["on"] == results["off"] == results["packed"] == results["paged"]
    assert all(f == results["on"][0][1] for f in results["on"][1])


def test_memory_pressure_trims_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = make_cache(prefix_caching=False, kept_watermark=0.0, kept_idle_seconds=3600.0)
    cache.admit(0, [1] * 100)
    cache.free(0)
    monkeypatch.setattr(vattention_cache, "memory_pressure", lambda fraction: True)
    cache._trim_if_due()  # what the trimmer thread runs each second
    assert cache.stats().units_kept == 0 and cache.stats().pages_returned == 4 * UNITS
    cache.close()


def test_a_preallocated_pool_keeps_its_memory_when_trimmed(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = make_cache(prefix_caching=False, kept_watermark=0.0, kept_idle_seconds=3600.0, preallocate=True)
    assert cache.driver.preallocated
    cache.admit(0, [1] * 100)
    cache.free(0)
    monkeypatch.setattr(vattention_cache, "memory_pressure", lambda fraction: True)
    cache._trim_if_due()
    assert cache.stats().units_kept == 0 and cache.stats().pages_returned == 0  # unmapped, kept backed
    cache.close()


def test_preallocation_is_refused_for_a_driver_the_cache_is_given() -> None:
    driver = HostDriver(8 * UNITS, PAGE)
    with pytest.raises(ValueError, match="preallocate"):
        make_cache(driver=driver, preallocate=True)
    driver.close()


class OnePagePerCallDriver(HostDriver):
    """CUDA's mapping rules on host memory: one page per map call, and memory kept on free."""

    merges_runs = False

    def _raw_punch(self, page: int) -> None:
        pass


def test_sharing_under_cuda_mapping_rules() -> None:
    """The same code path CudaDriver takes: pages mapped one per call at several offsets."""
    driver = OnePagePerCallDriver(8 * UNITS, PAGE)
    cache = make_cache(driver=driver)
    prompt = list(range(1, 65))
    cache.admit(0, prompt)
    compute(cache, 0, 0, 64, seed=0)
    before = keys(cache, 0, 64)
    assert cache.admit(1, prompt) == 63 and cache.stats().cow_copies == UNITS
    compute(cache, 1, 63, 64, seed=5)
    torch.testing.assert_close(keys(cache, 0, 64), before, rtol=0, atol=0)
    torch.testing.assert_close(keys(cache, 1, 63), before[:63], rtol=0, atol=0)
    cache.free(0)
    cache.free(1)
    cache.trim(force=True)
    assert cache.stats().pages_returned == 0  # a driver the cache was given keeps its memory
    cache.close()
    driver.close()


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_engine_outputs_under_preemption_are_identical_with_sharing_on_and_off(
    tiny_model_dir: Path, preemption_mode: str
) -> None:
    """Eight requests on one ~130-token prefix, two of them n = 2, in a budget that holds only a
    few at once: sequences are preempted and resumed while they share pages."""
    prefix = [(5 * i) % 300 + 3 for i in range(130)]
    prompts = [prefix + [40 + i] * (i + 1) for i in range(8)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, n=2 if i in (2, 5) else 1)
        for i in range(8)
    ]
    results = []
    for on in (True, False):
        llm = engine(
            tiny_model_dir, "vattention", on, kv_budget_bytes=8 * 8 * 4096, preemption_mode=preemption_mode
        )
        outs = llm.generate(prompts, params)
        results.append([[c.token_ids for c in o.outputs] for o in outs])
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0
        if on:
            assert stats.prefix_cache_hits > 0
            present = stats.kv_stats.present()  # /metrics shows each as vmkv:kv_<field>
            for gauge in (
                "units_kept",
                "shared_pages",
                "bytes_saved",
                "cow_copies",
                "prefix_cache_evictions",
            ):
                assert gauge in present
        cache = llm.engine.cache
        cache.trim(force=True)  # nothing leaked: only the watermark's kept sets may stay
        assert cache.pool.num_sets - cache.pool.free_count <= int(
            cache.config.kept_watermark * cache.pool.num_sets
        )
        llm.close()
    assert results[0] == results[1]


def test_a_swapped_in_sequence_indexes_again_the_chunks_evicted_while_it_was_out() -> None:
    cache = make_cache()
    prompt = list(range(1, 81))
    cache.admit(0, prompt)
    compute(cache, 0, 0, 80, seed=0)
    cache.swap_out([0])
    assert cache.prefix.evict(8) and not cache.prefix.chunks  # memory pressure took them all
    cache.swap_in([0])
    cache.grow(0, [81])
    compute(cache, 0, 80, 81, seed=1)
    assert len(cache.prefix.chunks) == 2  # from its own, restored pages
    assert cache.admit(1, prompt[:70]) == 64
    torch.testing.assert_close(keys(cache, 1, 64), keys(cache, 0, 64), rtol=0, atol=0)
    cache.free(0)
    cache.free(1)
    cache.close()


def test_the_premapped_reserve_outranks_the_least_recently_used_cached_chunk_at_the_peak() -> None:
    cache = make_cache(sets=4, premap_fraction=0.5)  # the reserve may hold 2 sets
    prompt = list(range(1, 129))
    cache.admit(0, prompt)
    compute(cache, 0, 0, 128, seed=0)  # 4 chunks cached, every set held: the peak
    cache.free(0)
    cache.table.mapping.drop_pages(cache.table.slots[0], 0)  # reclaimed: the index alone holds them
    with cache._lock:
        for job in cache._ahead.premap(30, slots=1):
            cache._ahead.run(job, background=True)
    stats = cache.stats()
    assert cache.table.reserve() == 1 and stats.prefix_cache_evictions == 1
    assert cache.pool.peak_held == 4 and stats.page_sets_free == 0
    assert cache.admit(1, prompt) == 96  # the prefix's tail went first; its head is still cached
    cache.close()


def test_a_prompt_told_as_it_arrives_is_backed_in_the_slot_its_admission_would_pick() -> None:
    # the admission would clear the lowest idle slot, which keeps a finished prompt's cached
    # chunks; backed ahead elsewhere, those chunks would stay mapped and could never be evicted
    cache = make_cache(sets=16, background_mapping=True, premap_fraction=0.0, ahead_bytes=0)
    prompt = list(range(1, 65))
    cache.admit(0, prompt)
    compute(cache, 0, 0, 64, seed=0)
    cache.wait_mapper()  # the look-ahead maps its third page
    cache.free(0)
    kept = cache.table.slots[0]
    assert len(kept.sets) == 3 and cache.pool.index_only == 0  # its 2 chunks are mapped there too
    cache.arrived([UpcomingPrompt([7] * 64)])
    cache.wait_mapper()
    critical = cache.stats().map_calls_critical
    cache.admit(1, [7] * 64)
    assert cache.seqs[1].slot == 0 and cache.stats().map_calls_critical == critical
    assert cache.pool.index_only == 2 and sum(len(s.sets) for s in cache.table.slots) == 2
    assert cache.admit(2, [*prompt, 99]) == 64  # still cached
    cache.close()


def test_a_kept_fork_becomes_reusable_once_no_other_slot_maps_its_shared_page() -> None:
    cache = make_cache(prefix_caching=False)
    cache.admit(0, list(range(1, 41)))
    compute(cache, 0, 0, 40, seed=0)
    cache.fork(0, 1)  # slot 1 shares slot 0's full page and copies the partly filled one
    child = cache.table.slots[cache.seqs[1].slot]
    cache.free(1)
    cache.free(0)
    assert cache.table.usable(child) == 0 and cache.table.reserve() == 0  # both keep the shared page
    # slot 0 drops what it kept, so the shared page is the child's alone: its slot joins the
    # reserve, whose last page the admission then takes (the reserve goes first)
    cache.admit(2, [7] * 10)
    assert cache.seqs[2].slot == 0 and child.sets == [0]
    assert cache.table.usable(child) == 1 and cache.table.reserve() == 1
    cache.close()


def test_a_reclaim_frees_a_batch_of_kept_pages_beyond_its_need() -> None:
    from vmkv.vattention.slots import RECLAIM_BATCH

    cache = make_cache(sets=128, deferred_reclamation=False)
    for i in range(32):  # every set ends up held by the index alone
        cache.admit(i, [i + 1] * 128)
        compute(cache, i, 0, 128, seed=i)
        cache.free(i)
    assert cache.pool.free_count == 0 and len(cache.prefix.chunks) == 128
    batch = int(RECLAIM_BATCH * 128)
    cache.admit(100, [999] * 32)  # one set: the index gives up one chunk, and a batch more
    assert cache.stats().prefix_cache_evictions == 1 + batch and cache.pool.free_count == batch
    for i in range(batch):  # the next admissions take free sets
        cache.admit(101 + i, [998 - i] * 32)
    assert cache.stats().prefix_cache_evictions == 1 + batch and cache.pool.free_count == 0
    cache.close()


def test_in_a_full_cache_the_mapper_backs_a_running_sequence_from_kept_pages() -> None:
    cache = make_cache(background_mapping=True, premap_slots=0, ahead_bytes=0)
    for i in range(4):  # every set ends up kept: by an idle slot and the index
        cache.admit(i, [i + 1] * 64)
        compute(cache, i, 0, 64, seed=i)
        cache.free(i)
    cache.admit(10, [9] * 31)
    compute(cache, 10, 0, 31, seed=10)
    cache.grow(10, [9])
    compute(cache, 10, 31, 32, seed=11)  # its prepare() queues the mapping of token 32's page
    cache.wait_mapper()
    before = cache.stats()
    assert cache.slot_pages(10) == 2 and before.ahead_skipped == 0
    cache.grow(10, [9])
    assert cache.stats().map_calls_critical == before.map_calls_critical  # nothing mapped on the step thread
    cache.close()
