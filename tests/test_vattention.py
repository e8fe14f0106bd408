"""Lifecycle, page accounting, optimisations and failure behaviour of the vattention layout."""

from __future__ import annotations

import errno

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from vmkv.drivers import HostDriver, RawCallError

from vmkv.kv_cache import KVShape, OutOfKVMemory, SeqStep, SequenceTooLong, StepBatch, UpcomingPrompt
from vmkv.vattention import VAttentionConfig, VAttentionKVCache
from vmkv.vattention.geometry import SlotGeometry
from vmkv.vattention.pool import PageSetPool

# 128 B per token per tensor: 32 tokens per 4 KiB page token-major, 64 per page head-major.
SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)
PAGE = 4096
MAX_LEN = 200
STRICT = {"background_mapping": False, "deferred_reclamation": False, "eager_steps": 0, "group_pad_pages": 0}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


ORDERS = ["token", "head", "packed"]


def units(order: str) -> int:
    """Pages per page set: one per column of every virtual region."""
    per_layer = 2 * SHAPE.num_layers
    return {"head": per_layer * SHAPE.num_kv_heads, "packed": 1}.get(order, per_layer)


def make_cache(num_sets: int = 16, **options: object) -> VAttentionKVCache:
    order = options.setdefault("order", "token")
    return VAttentionKVCache(SHAPE, MAX_LEN, num_sets * units(order) * PAGE, page_size=PAGE, **options)


def write(cache: VAttentionKVCache, steps: list[SeqStep], fill: dict[int, float]) -> None:
    """Run a step whose new K/V of sequence s are all fill[s] (V is -fill[s])."""
    batch = StepBatch.build(steps)
    plan = cache.prepare(batch)
    kv_shape = (SHAPE.num_kv_heads, SHAPE.head_dim)
    k = torch.cat([torch.full((s.num_new, *kv_shape), fill[s.seq_id]) for s in steps])
    q = torch.zeros(batch.num_tokens, 4, SHAPE.head_dim)
    for layer in range(SHAPE.num_layers):
        cache.attend(layer, q, k, -k, plan, 0.25)
    cache.finish_step(plan)


def stored(cache: VAttentionKVCache, seq_id: int, length: int) -> list[torch.Tensor]:
    """The K views of a sequence's first `length` tokens in every layer (copied out)."""
    slot = cache.seqs[seq_id].slot
    return [view[slot, :length].clone() for view in cache.mapping.k + cache.mapping.v]


def check_invariants(cache: VAttentionKVCache, strict: bool) -> None:
    """The issue's invariants, read under the cache lock so a running mapper cannot interleave."""
    geo, drv, pool = cache.geometry, cache.driver, cache.pool
    with cache._lock:
        holders: dict[int, int] = {}
        for slot in cache.table.slots:
            for set_id in slot.sets:
                holders[set_id] = holders.get(set_id, 0) + 1
            if slot.seq_id is None:
                continue
            seq = cache.seqs[slot.seq_id]
            assert seq.slot == slot.index
            needed = geo.pages_for(seq.length)
            # every token the sequence may write is backed, in every column of every tensor
            for res, base in cache.mapping.placed:
                for c in range(geo.columns):
                    off = base + geo.page_offset(slot.index, c, 0)
                    assert drv.is_mapped(res, off, seq.length * geo.column_token_bytes)
            assert len(slot.sets) >= needed
            if strict:  # nothing kept, nothing mapped ahead: exactly the pages the tokens touch
                assert len(slot.sets) == needed
        if strict:
            assert all(slot.sets == [] for slot in cache.table.slots if slot.seq_id is None)
        # a page is mapped once per slot holding its set; more than once only when shared by fork
        for set_id in range(pool.num_sets):
            assert pool.refcount[set_id] == holders.get(set_id, 0)
            for unit in range(geo.units):
                assert drv.map_count(pool.physical(set_id, unit)) == holders.get(set_id, 0)
        # the reserve kept from an earlier call is still what the kept sets make it
        assert cache.table.reserve() == sum(len(s.sets) for s in cache.table.private_idle())
        # the pool is conserved: every set is free or held, the driver maps exactly the held pages
        assert pool.free_count + len(holders) == pool.num_sets
        assert drv.stats.pages_mapped == sum(holders.values()) * geo.units
        assert cache.stats().mapper_errors == 0


# ---------------------------------------------------------------- accounting
@pytest.mark.parametrize("order", ORDERS)
def test_admit_grow_free_keep_page_accounting_exact(order: str) -> None:
    cache = make_cache(order=order, **STRICT)
    geo = cache.geometry
    cache.admit(1, [0] * 10)
    cache.admit(2, [0] * 32)
    assert cache.slot_pages(1) == geo.pages_for(10) and cache.slot_pages(2) == geo.pages_for(32)
    cache.grow(2, [0])
    assert cache.slot_pages(2) == geo.pages_for(33)
    for _ in range(70):
        cache.grow(1, [0])
    assert cache.slot_pages(1) == geo.pages_for(80)
    held = geo.pages_for(80) + geo.pages_for(33)
    assert cache.driver.stats.pages_mapped == held * geo.units
    mem = cache.memory()
    assert mem.allocated_bytes == held * geo.page_set_bytes
    assert mem.used_bytes == 113 * SHAPE.bytes_per_token
    assert mem.fragmentation_bytes == mem.allocated_bytes - mem.used_bytes
    check_invariants(cache, strict=True)
    cache.free(1)
    cache.free(2)
    assert cache.driver.stats.pages_mapped == 0 and cache.pool.free_count == cache.pool.num_sets
    assert cache.usage() == 0.0
    cache.close()


def test_token_major_pages_end_mid_token() -> None:
    """384 B tokens (SmolLM2): a 64 KiB page holds 170.67 tokens; token 170 straddles pages 0 and 1."""
    shape = KVShape(num_layers=1, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    cache = VAttentionKVCache(shape, 1024, 8 << 20, background_mapping=False, order="token")
    geo = cache.geometry
    assert geo.column_token_bytes == 384 and geo.tokens_backed(1) == 170
    assert geo.pages_for(170) == 1 and geo.pages_for(171) == 2
    cache.admit(0, [0] * 171)
    assert cache.slot_pages(0) == 2
    cache.close()


def test_packed_order_holds_every_layer_in_one_region_of_strided_views() -> None:
    """SmolLM2-135M's shape at the stock driver's 2 MiB pages: 23,040 B a token, 91 tokens a
    page, one page a growth step; each layer's K and V is a plain strided view of that region."""
    smollm = KVShape(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    geo = SlotGeometry(smollm, 2048, 4, 2 << 20, "packed")
    assert (geo.regions, geo.units, geo.column_token_bytes) == (1, 1, 23040)
    assert geo.tokens_backed(1) == 91 and geo.pages_for(92) == 2
    cache = make_cache(order="packed", **STRICT)
    assert len(cache.mapping.placed) == 1 and cache.geometry.units == 1
    row = SHAPE.num_kv_heads * SHAPE.head_dim
    token_stride = 2 * SHAPE.num_layers * row  # every layer's K and V of one token
    views = cache.mapping.tensors()
    for t, view in enumerate(views):
        assert view.stride() == (cache.geometry.slot_bytes // 4, token_stride, SHAPE.head_dim, 1)
        assert view.data_ptr() == views[0].data_ptr() + t * row * 4
    cache.admit(1, [0] * 20)
    cache.admit(2, [0] * 9)
    write(cache, [SeqStep(1, 0, 20), SeqStep(2, 0, 9)], {1: 1.0, 2: 2.0})
    write(cache, [SeqStep(1, 19, 1)], {1: 5.0})  # rewrite one token: no other layer or token moves
    k0, k1, v0, v1 = stored(cache, 1, 20)
    assert all(k[:19].eq(1.0).all() and v[:19].eq(-1.0).all() for k, v in [(k0, v0), (k1, v1)])
    assert k0[19].eq(5.0).all() and v1[19].eq(-5.0).all()
    assert all(view.eq(2.0 if i < 2 else -2.0).all() for i, view in enumerate(stored(cache, 2, 9)))
    check_invariants(cache, strict=True)
    cache.close()


def test_auto_order_with_a_page_size_is_layer_packed() -> None:
    shape = KVShape(num_layers=2, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)  # 1,536 B a token
    small = VAttentionKVCache(shape, 1024, 8 << 20, page_size=64 << 10, background_mapping=False)
    large = VAttentionKVCache(shape, 8192, 8 << 20, page_size=2 << 20, background_mapping=False)
    assert small.geometry.order == "packed" and small.geometry.tokens_backed(1) == 42
    assert large.geometry.order == "packed" and large.geometry.tokens_backed(1) == 1365
    small.close()
    large.close()


@pytest.mark.parametrize("amx", [False, True])
def test_default_layout_follows_the_cpu(monkeypatch: pytest.MonkeyPatch, amx: bool) -> None:
    """Neither order nor page size given: token-major at 16 KiB pages where the CPU has AMX tiles,
    layer-packed at 64 KiB elsewhere (docs/vattention.md, "The default layout")."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    shape = KVShape(num_layers=2, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    cache = VAttentionKVCache(shape, 1024, 8 << 20, background_mapping=False)
    expected = ("token", 16 << 10) if amx else ("packed", 64 << 10)
    assert (cache.geometry.order, cache.geometry.page_size) == expected
    assert cache.layout == (
        "vattention, token-major, 16 KiB pages" if amx else "vattention, layer-packed, 64 KiB pages"
    )
    cache.close()
    given = VAttentionKVCache(shape, 1024, 8 << 20, background_mapping=False, order="token")
    assert given.geometry.page_size == 64 << 10  # an order given alone keeps the CPU's usual page
    given.close()


# --------------------------------------------------------------- exhaustion
@pytest.mark.parametrize("options", [STRICT, {}], ids=["strict", "optimised"])
def test_pool_exhaustion_raises_before_any_change_and_cache_stays_usable(options: dict) -> None:
    cache = make_cache(num_sets=4, **options)
    cache.admit(1, [0] * 64)  # 2 sets
    cache.admit(2, [0] * 60)  # 2 sets
    write(cache, [SeqStep(1, 0, 64), SeqStep(2, 0, 60)], {1: 1.0, 2: 2.0})
    cache.wait_mapper()

    def snapshot() -> tuple:
        data = stored(cache, 1, 64) + stored(cache, 2, 60)
        return data, cache.pool.free_count, cache.driver.stats.pages_mapped

    before = snapshot()
    with pytest.raises(OutOfKVMemory) as err:
        cache.admit(3, [0] * 40)
    assert err.value.unit == "pages" and err.value.needed == 2 * cache.geometry.units
    with pytest.raises(OutOfKVMemory):
        cache.grow(1, [0] * 5)
    assert cache.seqs[1].length == 64 and 3 not in cache.seqs
    assert not cache.can_admit(40)
    after = snapshot()
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0], strict=True))
    assert before[1:] == after[1:]
    cache.free(2)
    assert cache.can_admit(40)
    cache.admit(3, [0] * 20)
    cache.grow(1, [0] * 5)
    check_invariants(cache, strict=False)
    cache.close()


def test_a_map_the_os_refuses_is_undone_and_reported_as_out_of_memory() -> None:
    """mmap fails with ENOMEM at vm.max_map_count: the half-mapped page set is rolled back."""
    cache = make_cache(**STRICT)
    cache.admit(1, [0] * 10)
    raw_map, calls = cache.driver._raw_map, []

    def failing_map(addr: int, first_page: int, num_pages: int) -> None:
        calls.append(addr)
        if len(calls) >= 3:
            raise RawCallError(errno.ENOMEM, "map failed: Cannot allocate memory")
        raw_map(addr, first_page, num_pages)

    cache.driver._raw_map = failing_map
    with pytest.raises(OutOfKVMemory):
        cache.grow(1, [0] * 40)
    with pytest.raises(OutOfKVMemory):
        cache.admit(2, [0] * 5)
    assert cache.seqs[1].length == 10 and 2 not in cache.seqs
    check_invariants(cache, strict=True)
    cache.driver._raw_map = raw_map
    cache.grow(1, [0] * 40)
    check_invariants(cache, strict=True)
    cache.close()


def test_out_of_slots_is_reported_in_slots() -> None:
    cache = make_cache(max_slots=2, **STRICT)
    cache.admit(1, [0])
    cache.admit(2, [0])
    with pytest.raises(OutOfKVMemory) as err:
        cache.admit(3, [0])
    assert err.value.unit == "slots"
    cache.close()


# --------------------------------------------------------- optimisations
def test_deferred_reclamation_reuses_kept_pages_without_mapping() -> None:
    cache = make_cache(background_mapping=False, deferred_reclamation=True)
    cache.admit(1, [0] * 100)  # 4 sets
    cache.free(1)
    assert cache.stats().page_sets_idle_kept == 4
    calls = cache.stats().map_calls_critical
    cache.admit(2, [0] * 90)
    c = cache.stats()
    assert c.map_calls_critical == calls and c.page_sets_reused == 3
    check_invariants(cache, strict=False)
    cache.close()


def test_deferred_pages_are_reclaimed_under_pressure_before_reporting_short() -> None:
    cache = make_cache(num_sets=6, background_mapping=False, deferred_reclamation=True)
    cache.admit(1, [0] * 100)  # 4 sets, kept after free
    cache.admit(2, [0] * 10)
    cache.free(1)
    cache.admit(3, [0] * 10)  # takes slot 0, which keeps 3 sets more than it needs
    cache.grow(2, [0] * 100)  # needs 3 more sets: 1 free + 2 reclaimed from slot 0
    assert cache.stats().page_sets_reclaimed == 2 and cache.pool.free_count == 0
    assert cache.usage() == 5 / 6  # slot 0's last surplus set is still reclaimable
    check_invariants(cache, strict=False)
    cache.close()


def test_pages_a_step_reads_are_not_reclaimed_until_the_next_step() -> None:
    """Group padding maps surplus pages the batched SDPA call reads; pressure must not take them mid-step."""
    cache = make_cache(
        num_sets=6, background_mapping=False, deferred_reclamation=False, group_pad_pages=1, attention="sdpa"
    )
    cache.admit(1, [0] * 33)  # 2 sets
    cache.admit(2, [0] * 20)  # 1 set, padded to 2 so slots 0 and 1 batch
    cache.grow(1, [0])
    cache.grow(2, [0])
    plan = cache.prepare(StepBatch.build([SeqStep(1, 33, 1), SeqStep(2, 20, 1)]))
    assert len(plan.groups) == 1 and cache.slot_pages(2) == 2
    with pytest.raises(OutOfKVMemory):
        cache.admit(3, [0] * 70)  # 3 sets: 2 free + the pinned surplus would be needed
    res, base = cache.mapping.placed[0]
    assert cache.driver.is_mapped(res, base + cache.geometry.page_offset(1, 0, 0), 34 * 128)
    cache.prepare(StepBatch.build([SeqStep(1, 33, 1)]))  # the next step no longer reads slot 1's surplus
    cache.admit(3, [0] * 70)
    assert cache.slot_pages(2) == 1
    check_invariants(cache, strict=False)
    cache.close()


def test_eager_allocation_maps_steps_ahead_and_gives_them_up_under_pressure() -> None:
    cache = make_cache(num_sets=3, background_mapping=False, deferred_reclamation=False, eager_steps=40)
    cache.admit(1, [0] * 10)
    assert cache.slot_pages(1) == cache.geometry.pages_for(50) == 2
    cache.admit(2, [0] * 40)  # needs 2 sets: 1 free + the eager one of sequence 1
    assert cache.slot_pages(1) == 1 and cache.stats().page_sets_reclaimed == 1
    check_invariants(cache, strict=False)
    cache.close()


def test_background_mapper_maps_next_step_off_the_critical_path() -> None:
    cache = make_cache(deferred_reclamation=False, ahead_bytes=0)  # one page at a time
    cache.admit(1, [0] * 32)  # exactly one page: the next token needs a second
    write(cache, [SeqStep(1, 0, 32)], {1: 1.0})
    cache.wait_mapper()
    c = cache.stats()
    assert cache.slot_pages(1) == 2 and c.map_calls_background > 0
    assert c.mapper_cpu_seconds > 0  # the thread's CPU reaches the stats (and /metrics)
    cache.grow(1, [0])
    assert cache.stats().map_calls_critical == c.map_calls_critical
    cache.close()
    assert not cache._mapper.alive


def test_the_mapper_backs_a_growing_sequence_ahead_bytes_at_a_time_in_one_call() -> None:
    # packed pages of 8 tokens: 3 a job, so the mapper wakes once every 3 pages, not at every page
    cache = make_cache(num_sets=32, order="packed", deferred_reclamation=False, ahead_bytes=3 * PAGE)
    cache.admit(1, [0] * 8)  # one page: the next token needs a second
    write(cache, [SeqStep(1, 0, 8)], {1: 1.0})
    cache.wait_mapper()
    first = cache.stats()
    assert cache.slot_pages(1) == 4 and first.map_calls_background == 1  # consecutive sets, one call
    for t in range(8, 32):  # tokens up to 32 fit the 4 pages: no job, nothing on the step thread
        cache.grow(1, [0])
        write(cache, [SeqStep(1, t, 1)], {1: 1.0})
    cache.wait_mapper()
    later = cache.stats()
    assert cache.slot_pages(1) == 7 and later.map_calls_background == 2
    assert later.map_calls_critical == first.map_calls_critical
    # the pages mapped ahead are the running sequence's surplus: another sequence may reclaim them
    assert cache.table.reclaimable(cache.table.slots[cache.seqs[1].slot]) == 7 - 4  # 32 tokens: 4 pages
    check_invariants(cache, strict=False)
    cache.close()


def test_pages_mapped_ahead_are_reclaimable_once_the_step_that_pinned_them_finished() -> None:
    # 8 sets of 8 tokens: sequence 1 holds 4 (2 needed, 2 mapped ahead and pinned by its next
    # step's prepare); after that step a 48-token prompt needs 6 of the 8, so 2 of the surplus
    cache = make_cache(
        num_sets=8, order="packed", deferred_reclamation=False, ahead_bytes=3 * PAGE, premap_slots=0
    )
    cache.admit(1, [0] * 8)
    write(cache, [SeqStep(1, 0, 8)], {1: 1.0})
    cache.wait_mapper()
    assert cache.slot_pages(1) == 4
    for t in range(8, 10):
        cache.grow(1, [0])
        write(cache, [SeqStep(1, t, 1)], {1: 1.0})  # its prepare pins the 4 pages; finish unpins
    cache.admit(2, [1] * 48)
    assert cache.slot_pages(1) == 2 and cache.slot_pages(2) == 6
    torch.testing.assert_close(stored(cache, 1, 10)[0], torch.ones(10, 2, 16))  # its tokens kept
    check_invariants(cache, strict=False)
    cache.close()


def test_mapper_premaps_idle_slots_so_an_admission_maps_nothing_on_the_step_thread() -> None:
    # packed pages hold 8 tokens here: four idle slots of 5 pages fill the reserve (20 of 32 sets)
    cache = make_cache(num_sets=32, order="packed", premap_slots=4, premap_tokens=40, premap_fraction=0.625)
    cache.wait_mapper()
    assert [len(s.sets) for s in cache.table.slots if s.sets] == [5] * 4
    stats = cache.stats()
    assert stats.map_calls_critical == 0 and stats.map_calls_background > 0 and stats.units_kept == 20
    assert cache.free_capacity() == 32 * 8  # pre-mapped pages count as free
    cache.admit(1, [0] * 37)
    assert cache.stats().map_calls_critical == 0 and cache.stats().page_sets_reused == 5
    write(cache, [SeqStep(1, 0, 37)], {1: 1.0})
    cache.wait_mapper()  # one admission a step now: the three pre-mapped slots left suffice
    assert [len(s.sets) for s in cache.table.idle() if s.sets] == [5] * 3
    cache.admit(2, [0] * 40)
    assert cache.stats().map_calls_critical == 0 and cache.stats().page_sets_reused == 10
    check_invariants(cache, strict=False)
    cache.close()


def test_a_growing_slot_continues_its_run_while_the_reserve_gives_up_pages() -> None:
    # four idle slots of 5 pre-mapped sets spread over 32 (0, 11, 18, 27); the admitted one grows
    # to 25 sets: the reserve gives up as many (the held total stays), but the slot's physical
    # run goes on unbroken, where a layer-packed run would become huge pages
    cache = make_cache(num_sets=32, order="packed", premap_slots=4, premap_tokens=40, premap_fraction=0.625)
    cache.wait_mapper()
    assert sorted(s.sets[0] for s in cache.table.slots if s.sets) == [0, 11, 18, 27]
    cache.admit(1, [0] * 37)
    write(cache, [SeqStep(1, 0, 37)], {1: 1.0})
    for t in range(37, 200):
        cache.grow(1, [0])
        write(cache, [SeqStep(1, t, 1)], {1: 1.0})
    cache.wait_mapper()
    assert cache.stats().page_sets_reclaimed > 0
    assert cache.table.slots[cache.seqs[1].slot].sets == list(range(25))
    check_invariants(cache, strict=False)
    cache.close()


def test_layer_packed_slots_span_whole_huge_page_runs_and_start_on_one() -> None:
    """With 64 KiB pages a 2 MiB run is 32 pages: a packed column is whole runs, so every slot
    starts on one, and a fresh slot's first set is a multiple of 32; per-layer orders keep
    their columns (their rows are not a page apart)."""
    smollm = KVShape(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    packed = SlotGeometry(smollm, 2048, 4, 64 << 10, "packed", huge_run=2 << 20)
    assert packed.run_pages == 32 and packed.column_pages == 736  # 720 pages hold 2,048 tokens
    assert packed.slot_bytes % (2 << 20) == 0
    assert SlotGeometry(smollm, 2048, 4, 64 << 10, "packed").column_pages == 720
    for order in ("token", "head"):
        plain = SlotGeometry(smollm, 2048, 4, 64 << 10, order)
        assert (
            SlotGeometry(smollm, 2048, 4, 64 << 10, order, huge_run=2 << 20).column_pages
            == plain.column_pages
        )
    pool = PageSetPool(list(range(256)), units=1, run=32)
    starts = [pool.take(10, None)[0] for _ in range(4)]
    assert starts == [0, 128, 64, 192]  # middles of the largest free runs, rounded down to runs
    unaligned = PageSetPool(list(range(256)), units=1)
    assert [unaligned.take(10, None)[0] for _ in range(2)] == [0, 133]


def test_a_layer_packed_slot_at_64_kib_pages_reads_its_full_runs_through_huge_pages() -> None:
    smollm = KVShape(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    cache = VAttentionKVCache(smollm, 512, 256 << 16, page_size=1 << 16, order="packed", **STRICT)
    if not cache.driver.huge_run:
        pytest.skip("no 2 MiB transparent huge pages here, or pages are not populated")
    cache.admit(1, [0] * 200)  # 71 pages of 23,040-byte tokens: two full runs of 32, and 7
    slot = cache.table.slots[cache.seqs[1].slot]
    if not cache.driver.huge_extents:
        assert not cache.driver.huge_run  # the kernel refused MADV_COLLAPSE: collapsing stopped
        pytest.skip("this kernel cannot collapse shared memory")
    first = slot.sets[0]
    assert first % 32 == 0 and cache.driver.huge_extents == {first // 32, first // 32 + 1}
    start = cache.mapping.k[0][slot.index].data_ptr()
    with open("/proc/self/smaps") as f:  # the slot's mapping, its two full runs PMD-mapped
        fields = f.read().split(f"{start:x}-")[1].split("VmFlags")[0]
    assert "ShmemPmdMapped:     4096 kB" in fields
    cache.close()


def test_a_premapping_job_still_queued_is_not_queued_again() -> None:
    # every free() asks for the reserve again: sequences finishing together asked for the same
    # few jobs thousands of times, and each copy walked the slots on the mapper thread
    cache = make_cache(num_sets=32, order="packed", premap_slots=2, premap_tokens=16, premap_fraction=0.5)
    cache.wait_mapper()
    assert [len(s.sets) for s in cache.table.slots if s.sets] == [2, 2]
    jobs = cache._ahead.premap(32, 2)
    assert sorted(job.target_tokens for job in jobs) == [32, 32]
    assert cache._ahead.premap(32, 2) == []  # queued: not again
    cache._mapper.submit(jobs)
    cache.wait_mapper()
    assert [len(s.sets) for s in cache.table.slots if s.sets] == [4, 4]
    assert cache._ahead.premap(32, 2) == []  # done: nothing left to do
    assert len(cache._ahead.premap(48, 2)) == 2  # a new target is new work
    cache.close()


def test_the_premapped_reserve_stays_within_its_share_and_goes_when_the_cache_is_quiet() -> None:
    # 1/16 of 32 sets: one slot of 2 pages (16 tokens), not the 16 slots asked for
    cache = make_cache(num_sets=32, order="packed", premap_tokens=16, kept_idle_seconds=3600)
    cache.wait_mapper()
    assert cache.table.reserve() == 2 and cache.peaks.reserve == 2
    cache.admit(1, [0] * 12)
    write(cache, [SeqStep(1, 0, 12)], {1: 1.0})
    cache.free(1)
    cache.wait_mapper()
    assert cache.table.reserve() <= 2 and cache.peaks.backing == 2
    assert cache.trim() == 0  # admitted just now
    cache._last_admit -= 7200
    assert cache.trim() == 2 and cache.table.reserve() == 0
    check_invariants(cache, strict=True)
    cache.close()


def test_freshly_premapped_slots_are_not_trimmed_as_long_idle() -> None:
    # every kept set is beyond a zero watermark, but the reserve's pages were mapped just now
    options = {"premap_tokens": 16, "kept_idle_seconds": 3600, "kept_watermark": 0.0}
    cache = make_cache(num_sets=32, order="packed", **options)
    cache.wait_mapper()
    assert cache.table.reserve() == 2
    assert cache.trim() == 0 and cache.table.reserve() == 2
    cache.close()


def test_a_prompt_longer_than_a_reserve_slot_takes_its_other_pages_from_the_reserve() -> None:
    # four reserve slots of 2 pages (16 tokens); an 80-token prompt needs 10 pages
    cache = make_cache(num_sets=32, order="packed", premap_slots=4, premap_tokens=16, premap_fraction=0.25)
    cache.wait_mapper()
    assert cache.table.reserve() == 8
    cache.admit(1, [0] * 80)  # 2 reused, 6 converted from the other slots, 2 free
    assert cache.slot_pages(1) == 10 and cache.pool.num_sets - cache.pool.free_count == 10
    assert cache.table.reserve() == 0 and cache.stats().page_sets_reclaimed == 6
    check_invariants(cache, strict=False)
    cache.close()


def reserve_cache(premap_slots: int, premap_tokens: int) -> VAttentionKVCache:
    """A packed cache whose reserve is built: room for it in half the sets, and no look-ahead
    chunk, which would fill the held peak the reserve stays within."""
    options = {"premap_fraction": 0.5, "ahead_bytes": 0}
    cache = make_cache(
        num_sets=64, order="packed", premap_slots=premap_slots, premap_tokens=premap_tokens, **options
    )
    cache.wait_mapper()
    return cache


def test_the_reserve_keeps_twice_the_most_admissions_of_one_step_backed() -> None:
    # one admission a step, of 40 tokens (5 pages): two idle slots are backed for the next,
    # since arrivals at a rate come in bursts the last admitting steps did not show
    cache = reserve_cache(premap_slots=4, premap_tokens=16)
    cache.admit(1, [0] * 40)
    write(cache, [SeqStep(1, 0, 40)], {1: 1.0})
    cache.wait_mapper()
    assert sorted(len(s.sets) for s in cache.table.idle() if len(s.sets) >= 5) == [5, 5]
    check_invariants(cache, strict=False)
    cache.close()


def test_prompts_told_as_they_arrive_get_an_idle_slot_each_and_map_nothing_when_admitted() -> None:
    # told one at a time (as a receiver thread hears them), the second must not pick the slot
    # already chosen for the first: both are admitted into pages the mapper backed
    cache = reserve_cache(premap_slots=1, premap_tokens=8)
    cache.arrived([UpcomingPrompt([1] * 24)])
    cache.arrived([UpcomingPrompt([2] * 24)])
    cache.wait_mapper()
    assert sorted(len(s.sets) for s in cache.table.idle() if s.sets) == [3, 3]
    critical = cache.stats().map_calls_critical
    cache.admit(1, [1] * 24)
    cache.admit(2, [2] * 24)
    assert cache.stats().map_calls_critical == critical
    cache.arrived([UpcomingPrompt([3] * (MAX_LEN + 1))])  # longer than a slot: ignored, as admit refuses it
    check_invariants(cache, strict=False)
    cache.close()
    cache.arrived([UpcomingPrompt([4] * 8)])  # closed: nothing to do, no error


def test_premapped_pages_give_way_to_a_sequence_that_needs_them() -> None:
    cache = make_cache(num_sets=32, order="packed", premap_slots=4, premap_tokens=40, premap_fraction=0.625)
    cache.wait_mapper()
    cache.admit(1, [0] * MAX_LEN)  # 25 pages: 12 free, the rest reclaimed from pre-mapped slots
    assert cache.slot_pages(1) == 25 and cache.stats().page_sets_reclaimed > 0
    check_invariants(cache, strict=False)
    cache.close()


def test_waiting_prompts_find_idle_slots_backed_for_their_own_lengths() -> None:
    # no reserve (premap_fraction 0): only the prompts the scheduler names get slots, each at its
    # own length (3 and 5 pages at 8 tokens a page), above the held peak of two pages
    cache = make_cache(num_sets=32, order="packed", premap_fraction=0.0, ahead_bytes=0)
    cache.admit(1, [0] * 8)
    write(cache, [SeqStep(1, 0, 8)], {1: 1.0})
    cache.wait_mapper()
    assert cache.table.reserve() == 0
    cache.expect([UpcomingPrompt([1] * 17), UpcomingPrompt([2] * 40)])
    cache.grow(1, [0])
    write(cache, [SeqStep(1, 8, 1)], {1: 1.0})
    cache.wait_mapper()
    assert sorted(len(s.sets) for s in cache.table.idle() if s.sets) == [3, 5]
    critical = cache.stats().map_calls_critical
    cache.admit(2, [1] * 17)  # the best fit: the 3-page slot, though the 5-page one is lower
    cache.admit(3, [2] * 40)
    assert cache.stats().map_calls_critical == critical
    assert cache.table.reserve() == 0 and cache.slot_pages(2) == 3 and cache.slot_pages(3) == 5
    check_invariants(cache, strict=False)
    cache.close()


def test_a_waiting_prompt_with_a_cached_first_chunk_gets_no_slot_backed_ahead() -> None:
    cache = make_cache(num_sets=32, order="packed", premap_fraction=0.0, prefix_caching=True)
    prompt = list(range(40))
    cache.admit(1, prompt)
    write(cache, [SeqStep(1, 0, 40)], {1: 1.0})
    cache.free(1)  # the prefix index keeps its 5 pages
    cache.admit(2, [7] * 8)
    cache.wait_mapper()
    # a hit needs no slot backed ahead; the same tokens under another salt are a new prompt
    cache.expect([UpcomingPrompt(prompt + [1]), UpcomingPrompt(prompt, cache_salt="other")])
    write(cache, [SeqStep(2, 0, 8)], {2: 2.0})
    cache.wait_mapper()
    assert [len(s.sets) for s in cache.table.idle() if s.sets] == [5]  # the salted prompt's
    assert cache.table.reserve() == 5
    cache.close()


def test_mapper_job_for_a_freed_slot_is_dropped() -> None:
    cache = make_cache(deferred_reclamation=False)
    cache.admit(1, [0] * 32)
    with cache._lock:  # the mapper waits on this lock until the sequence is freed
        cache.prepare(StepBatch.build([SeqStep(1, 0, 32)]))
        cache.free(1)
    cache.wait_mapper()
    assert cache.driver.stats.pages_mapped == 0
    check_invariants(cache, strict=True)
    cache.close()


def test_background_mapper_never_races_free_under_stress() -> None:
    """Many admit/grow/step/free cycles while the mapper maps ahead for each step."""
    cache = make_cache(num_sets=10, eager_steps=24)
    live: dict[int, int] = {}
    next_id = 0
    for i in range(250):
        if len(live) < 4:
            n = 1 + (i * 37) % 90
            try:
                cache.admit(next_id, [0] * n)
                live[next_id] = n
                next_id += 1
            except OutOfKVMemory:
                pass
        steps = []
        for sid in list(live):
            try:
                cache.grow(sid, [0])
                live[sid] += 1
                steps.append(SeqStep(sid, live[sid] - 1, 1))
            except (OutOfKVMemory, SequenceTooLong):
                cache.free(sid)
                del live[sid]
        if steps:
            write(cache, steps, {s.seq_id: float(s.seq_id) for s in steps})
        if i % 7 == 0 and live:
            victim = min(live)
            cache.free(victim)
            del live[victim]
        if i % 50 == 0:
            check_invariants(cache, strict=False)
    cache.wait_mapper()
    check_invariants(cache, strict=False)
    # How much the mapper maps here is timing: starved on a busy machine, it finds every page
    # already mapped by the steps or its slot freed (a test above checks that it maps ahead).
    cache.close()
    assert not cache._mapper.alive and cache.driver.closed


# -------------------------------------------------------------- fork, swap
@pytest.mark.parametrize("order", ORDERS)
def test_fork_shares_full_pages_and_copies_the_partial_one(order: str) -> None:
    cache = make_cache(order=order, **STRICT)
    geo = cache.geometry
    full = geo.tokens_backed(2)  # two full pages
    cache.admit(1, [0] * (full + 5))
    write(cache, [SeqStep(1, 0, full + 5)], {1: 3.0})
    cache.fork(1, 2)
    parent, child = cache.table.slots[cache.seqs[1].slot], cache.table.slots[cache.seqs[2].slot]
    assert child.sets[:2] == parent.sets[:2] and child.sets[2] != parent.sets[2]
    assert all(cache.driver.map_count(cache.pool.physical(s, 0)) == 2 for s in parent.sets[:2])
    assert all(
        torch.equal(a, b) for a, b in zip(stored(cache, 1, full + 5), stored(cache, 2, full + 5), strict=True)
    )
    cache.grow(1, [0])
    cache.grow(2, [0])
    write(cache, [SeqStep(1, full + 5, 1), SeqStep(2, full + 5, 1)], {1: 7.0, 2: 9.0})
    assert stored(cache, 1, full + 6)[0][-1].eq(7.0).all() and stored(cache, 2, full + 6)[0][-1].eq(9.0).all()
    assert stored(cache, 2, full + 5)[0].eq(3.0).all()
    check_invariants(cache, strict=True)
    cache.free(1)  # the child still maps the shared pages: they stay out of the pool
    assert cache.pool.free_count == cache.pool.num_sets - geo.pages_for(full + 6)
    assert stored(cache, 2, full + 5)[0].eq(3.0).all()
    check_invariants(cache, strict=True)
    cache.free(2)
    assert cache.pool.free_count == cache.pool.num_sets
    cache.close()


def test_forked_pages_are_never_kept_for_reuse() -> None:
    """A kept shared page would be overwritten by the slot's next sequence."""
    cache = make_cache(background_mapping=False, deferred_reclamation=True)
    cache.admit(1, [0] * 70)
    write(cache, [SeqStep(1, 0, 70)], {1: 5.0})
    cache.fork(1, 2)
    cache.free(2)
    cache.admit(3, [0] * 70)
    write(cache, [SeqStep(3, 0, 70)], {3: 6.0})
    assert stored(cache, 1, 70)[0].eq(5.0).all()
    check_invariants(cache, strict=False)
    cache.close()


def test_swap_out_releases_pages_and_swap_in_restores_kv() -> None:
    cache = make_cache(num_sets=4, **STRICT)
    cache.admit(1, [0] * 100)
    write(cache, [SeqStep(1, 0, 100)], {1: 4.0})
    before = stored(cache, 1, 100)
    cache.swap_out([1])
    assert cache.pool.free_count == 4 and cache.driver.stats.pages_mapped == 0
    with pytest.raises(ValueError, match="swapped out"):
        cache.grow(1, [0])
    cache.admit(2, [0] * 40)
    with pytest.raises(OutOfKVMemory):
        cache.swap_in([1])
    assert cache.seqs[1].slot == -1
    cache.free(2)
    cache.swap_in([1])
    assert all(torch.equal(a, b) for a, b in zip(before, stored(cache, 1, 100), strict=True))
    check_invariants(cache, strict=True)
    cache.close()


# ---------------------------------------------------------------- misuse
def test_wrong_calls_raise_precise_errors() -> None:
    cache = make_cache(**STRICT)
    with pytest.raises(ValueError, match="empty"):
        cache.admit(1, [])
    with pytest.raises(SequenceTooLong):
        cache.admit(1, [0] * (MAX_LEN + 1))
    cache.admit(1, [0] * 10)
    with pytest.raises(ValueError, match="already"):
        cache.admit(1, [0])
    with pytest.raises(KeyError):
        cache.grow(9, [0])
    with pytest.raises(SequenceTooLong):
        cache.grow(1, [0] * MAX_LEN)
    with pytest.raises(ValueError, match="room for 10"):
        cache.prepare(StepBatch.build([SeqStep(1, 5, 6)]))
    with pytest.raises(ValueError, match="twice"):
        cache.prepare(StepBatch.build([SeqStep(1, 0, 1), SeqStep(1, 1, 1)]))
    plan = cache.prepare(StepBatch.build([SeqStep(1, 0, 10)]))
    kv = torch.zeros(10, 2, 16)
    with pytest.raises(IndexError):
        cache.attend(2, torch.zeros(10, 4, 16), kv, kv, plan, 1.0)
    with pytest.raises(ValueError, match="q must be"):
        cache.attend(0, torch.zeros(10, 3, 16), kv, kv, plan, 1.0)
    with pytest.raises(ValueError, match="k and v"):
        cache.attend(0, torch.zeros(10, 4, 16), kv[:9], kv[:9], plan, 1.0)
    with pytest.raises(TypeError, match="float32"):
        cache.attend(0, torch.zeros(10, 4, 16), kv.double(), kv.double(), plan, 1.0)
    with pytest.raises(TypeError, match="plan"):
        cache.attend(0, torch.zeros(10, 4, 16), kv, kv, object(), 1.0)
    with pytest.raises(ValueError, match="order"):
        make_cache(order="diagonal")
    with pytest.raises(TypeError):
        make_cache(no_such_option=True)
    with pytest.raises(ValueError, match="no memory driver"):
        VAttentionKVCache(SHAPE, MAX_LEN, 1 << 20, "meta")
    with pytest.raises(ValueError, match="no page set"):
        VAttentionKVCache(SHAPE, MAX_LEN, PAGE, page_size=PAGE, order="token")  # 4 pages a set
    cache.close()
    with pytest.raises(RuntimeError, match="closed"):
        cache.admit(2, [0])


def test_runs_over_a_given_driver_and_returns_its_pages() -> None:
    driver = HostDriver(num_pages=64, page_size=PAGE)
    config = VAttentionConfig(background_mapping=False, order="token")
    cache = VAttentionKVCache(SHAPE, MAX_LEN, driver=driver, config=config)
    assert driver.free_page_count == 0 and cache.pool.num_sets == 16
    cache.admit(1, [0] * 50)
    cache.close()
    assert driver.free_page_count == 64 and not driver.closed
    driver.close()


def test_consecutive_sets_keep_a_slot_in_one_mapping_per_column() -> None:
    """Growing page by page continues the physical run, so the host kernel merges it into one VMA."""
    cache = make_cache(num_sets=32, **STRICT)
    cache.admit(1, [0] * 2)
    cache.admit(2, [0] * 2)
    for _ in range(150):
        cache.grow(1, [0])
        cache.grow(2, [0])
    for sid in (1, 2):
        sets = cache.table.slots[cache.seqs[sid].slot].sets
        assert sets == list(range(sets[0], sets[0] + len(sets)))
    res, base = cache.mapping.placed[0]
    start, end = res.base + base, res.base + base + cache.geometry.region_bytes
    with open("/proc/self/maps") as maps:
        fields = [line.split() for line in maps]
    mapped = [f for f in fields if start <= int(f[0].split("-")[0], 16) < end and f[1].startswith("rw")]
    assert len(mapped) == 2  # one VMA per slot
    cache.close()


# ------------------------------------------------------- property-based
class Lifecycle(RuleBasedStateMachine):
    """Random admit/grow/fork/free/swap/step sequences; data and page invariants after each."""

    def __init__(self) -> None:
        super().__init__()
        self.cache: VAttentionKVCache | None = None
        self.lengths: dict[int, int] = {}  # seq -> tokens reserved
        self.written: dict[int, list[float]] = {}  # seq -> fill value of each written token
        self.swapped: set[int] = set()
        self.next_id = 0
        self.strict = False

    @initialize(
        order=st.sampled_from(ORDERS),
        deferred=st.booleans(),
        mapper=st.booleans(),
        eager=st.sampled_from([0, 0, 5, 40]),
        pad=st.sampled_from([0, 1]),
    )
    def start(self, order: str, deferred: bool, mapper: bool, eager: int, pad: int) -> None:
        self.strict = not (deferred or mapper or eager or pad)
        self.cache = make_cache(
            num_sets=32 if order == "packed" else 8,  # packed: 32 pages of 8 tokens, as token-major's 8 sets
            order=order,
            deferred_reclamation=deferred,
            background_mapping=mapper,
            eager_steps=eager,
            group_pad_pages=pad,
        )
        self.cache.wait_mapper()  # idle slots pre-mapped at construction

    def teardown(self) -> None:
        if self.cache is not None:
            self.cache.close()

    def resident(self) -> list[int]:
        return [s for s in self.lengths if s not in self.swapped]

    @rule(n=st.integers(1, 120))
    def admit(self, n: int) -> None:
        try:
            self.cache.admit(self.next_id, [0] * n)
        except OutOfKVMemory:
            return
        self.lengths[self.next_id] = n
        self.written[self.next_id] = []
        self.next_id += 1

    @precondition(lambda self: self.resident())
    @rule(data=st.data(), n=st.integers(1, 40))
    def grow(self, data: st.DataObject, n: int) -> None:
        sid = data.draw(st.sampled_from(self.resident()))
        try:
            self.cache.grow(sid, [0] * n)
        except (OutOfKVMemory, SequenceTooLong):
            return
        self.lengths[sid] += n

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """Write every unwritten reserved token of some sequences (a prefill chunk or a decode)."""
        chosen = data.draw(st.sets(st.sampled_from(self.resident()), min_size=1))
        steps = [
            SeqStep(s, len(self.written[s]), self.lengths[s] - len(self.written[s]))
            for s in sorted(chosen)
            if self.lengths[s] > len(self.written[s])
        ]
        if not steps:
            return
        fill = {s.seq_id: float(self.next_id * 1000 + s.seq_id) for s in steps}
        self.next_id += 1
        write(self.cache, steps, fill)
        self.cache.wait_mapper()  # what the mapper maps decides later rules' outcomes: not timing
        for s in steps:
            self.written[s.seq_id] += [fill[s.seq_id]] * s.num_new

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self.resident()))
        try:
            self.cache.fork(parent, self.next_id)
        except OutOfKVMemory:
            return
        self.lengths[self.next_id] = self.lengths[parent]
        self.written[self.next_id] = list(self.written[parent])
        self.next_id += 1

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.lengths)))
        self.cache.free(sid)
        del self.lengths[sid], self.written[sid]
        self.swapped.discard(sid)

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(self.resident()))
        self.cache.swap_out([sid])
        self.swapped.add(sid)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.swapped)))
        try:
            self.cache.swap_in([sid])
        except OutOfKVMemory:
            return
        self.swapped.discard(sid)

    @invariant()
    def pages_are_consistent(self) -> None:
        if self.cache is not None:
            check_invariants(self.cache, self.strict)

    @invariant()
    def no_sequence_sees_another_ones_data(self) -> None:
        if self.cache is None:
            return
        for sid in self.resident():
            want = torch.tensor(self.written[sid])
            if not len(want):
                continue
            half = SHAPE.num_layers
            for i, kv in enumerate(stored(self.cache, sid, len(want))):
                assert torch.equal(kv[:, 0, 0], want if i < half else -want), (sid, kv[:, 0, 0], want)


Lifecycle.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_lifecycle = Lifecycle.TestCase
