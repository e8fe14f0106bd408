"""The KV-cache contract, the same for every layout: one state machine, run over all three.

Random admit / grow / step / fork / free / swap / preempt / evict sequences through the public
API only (prompts with and without a cache salt). A token's K/V are a fixed function of its
prefix (as a model's are, which is what lets the paged prefix cache hand out cached KV), so
every step checks attention against the reference over what each sequence must hold: no
sequence ever sees another one's data, a fork or a swap brings back exactly what was there, a
prefix hit is the right KV. A step's attention is called as a model's layers call it (the
`vmkv::attention` op, native in a decode-kernel step) or through attend() itself. A failed
call (OutOfKVMemory, SequenceTooLong) changes nothing, can_admit never promises what admit
refuses, nothing is freed twice, and once everything is freed the cache has exactly its first
capacity again. Where a layout shares physical memory
(vattention), its references are checked after every rule: each page set's count is its mappers
plus the prefix index, the free list is exactly the sets nobody holds, sequences of different
salts share nothing, and once everything is freed and the kept pages trimmed every count is
zero.
"""

from __future__ import annotations

import functools
import hashlib
from contextlib import nullcontext

import pytest
import torch
from attention_reference import reference_attention
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from vmkv.drivers import HostMemoryError, host
from vmkv.paging import PagedKVCache

from vmkv.contiguous import ContiguousKVCache
from vmkv.engine.attention_hook import attention_op, step_context
from vmkv.kv_cache import KVCache, KVShape, OutOfKVMemory, SeqStep, SequenceTooLong, StepBatch
from vmkv.vattention import VAttentionKVCache
from vmkv.vattention import budget as budget_module

# 128 B per token per K or V tensor: a 4 KiB vattention page holds 32 tokens token-major
SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)
Q_HEADS, MAX_LEN, SCALE, PAGE = 4, 80, 0.25, 4096
LAYOUTS = ("vattention", "paged", "contiguous")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@functools.cache
def kv_of(layer: int, prefix: tuple[int, ...]) -> torch.Tensor:
    """[2, Hkv, D]: K and V of the last token of `prefix` in `layer`."""
    digest = hashlib.blake2b(repr((layer, prefix)).encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest, "little"))
    return torch.randn(2, SHAPE.num_kv_heads, SHAPE.head_dim, generator=generator)


def build(layout: str, option: int) -> KVCache:
    """A small cache of the layout; `option` picks one of its variants."""
    if layout == "vattention":
        variants = [
            {"deferred_reclamation": False, "eager_steps": 0, "group_pad_pages": 0},
            {"deferred_reclamation": True, "eager_steps": 40, "group_pad_pages": 1},
            {"deferred_reclamation": True, "eager_steps": 0, "order": "head"},
            {"deferred_reclamation": False, "eager_steps": 0, "prefix_caching": True},
            {"deferred_reclamation": True, "eager_steps": 8, "prefix_caching": True},
            {"deferred_reclamation": True, "order": "head", "prefix_caching": True},
            {"deferred_reclamation": True, "eager_steps": 8, "order": "packed", "group_pad_pages": 1},
            {"deferred_reclamation": True, "order": "packed", "prefix_caching": True},
        ]
        options = {
            "order": "token",
            "background_mapping": False,
            "kept_watermark": 0.0,  # trim(force=True) then gives every kept page back
            "kept_idle_seconds": None,  # no trimming thread: rules decide when pages go
            "pressure_min_available": 0.0,
        } | variants[option]
        units = 2 * SHAPE.num_layers * (SHAPE.num_kv_heads if options["order"] == "head" else 1)
        if options["order"] == "packed":  # one page a set, 8 tokens a page: 28 pages hold 7 token-major sets
            units = 4
        return VAttentionKVCache(SHAPE, MAX_LEN, 7 * units * PAGE, page_size=PAGE, **options)
    if layout == "paged":
        budget = 20 * 8 * SHAPE.bytes_per_token
        return PagedKVCache(
            SHAPE, MAX_LEN, budget, block_size=8, enable_prefix_caching=option != 0, model_id="m"
        )
    return ContiguousKVCache(SHAPE, MAX_LEN, 3 * MAX_LEN * SHAPE.bytes_per_token)


class ContractLifecycle(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache: KVCache | None = None
        self.tokens: dict[int, list[int]] = {}  # every sequence in the cache -> its tokens
        self.computed: dict[int, int] = {}  # tokens whose KV a finished step wrote
        self.swapped: set[int] = set()
        self.freed: list[int] = []
        self.next_id = 0
        self.gen = torch.Generator().manual_seed(0)

    @initialize(layout=st.sampled_from(LAYOUTS), option=st.integers(0, 7))
    def start(self, layout: str, option: int) -> None:
        self.cache = build(layout, option if layout == "vattention" else option % 3)
        self.capacity = self.cache.free_capacity()
        self.salts: dict[int, str | None] = {}
        self.history: list[tuple[tuple[int, ...], str | None]] = []  # computed prompts, for prefix hits

    def teardown(self) -> None:
        if self.cache is None:
            return
        for seq_id in list(self.tokens):
            self.cache.free(seq_id)
        assert self.cache.free_capacity() == self.capacity  # nothing leaked
        assert self.cache.usage() == 0 and self.cache.memory().used_bytes == 0
        if isinstance(self.cache, VAttentionKVCache):
            self.cache.trim(force=True)
            assert all(r == 0 for r in self.cache.pool.refcount)  # every reference returned
            assert self.cache.pool.free_count == self.cache.pool.num_sets
            assert self.cache.stats().units_kept == 0
        self.cache.close()

    # ---------------------------------------------------------------- helpers
    def resident(self) -> list[int]:
        return sorted(set(self.tokens) - self.swapped)

    def computed_resident(self) -> list[int]:
        return [s for s in self.resident() if self.computed[s] == len(self.tokens[s])]

    def observe(self) -> tuple:
        cache = self.cache
        return cache.free_capacity(), cache.usage(), cache.memory(), cache.stats().units_in_use

    def truth(self, seq_id: int, layer: int, end: int, start: int = 0) -> torch.Tensor:
        """[2, end - start, Hkv, D]: the K/V the sequence's tokens start..end-1 must have."""
        tokens = self.tokens[seq_id]
        return torch.stack([kv_of(layer, tuple(tokens[: p + 1])) for p in range(start, end)], dim=1)

    def free_sequence(self, seq_id: int) -> None:
        self.cache.free(seq_id)
        del self.tokens[seq_id], self.computed[seq_id]
        self.swapped.discard(seq_id)
        self.freed.append(seq_id)

    def unchanged_on_failure(self, call: object, *args: object) -> bool:
        """Run call(*args); if it raises the 'cannot' errors, check that nothing changed."""
        before = self.observe()
        try:
            call(*args)
        except (OutOfKVMemory, SequenceTooLong):
            assert self.observe() == before
            return False
        return True

    # ------------------------------------------------------------------ rules
    @rule(
        base=st.sampled_from([[1] * 72, [1, 2] * 36, [3, 2, 1] * 24]),
        length=st.integers(1, 72),
        tail=st.lists(st.integers(1, 3), max_size=4),
        salt=st.sampled_from([None, None, "tenant-a"]),
    )
    def admit(self, base: list[int], length: int, tail: list[int], salt: str | None) -> None:
        """Prompts often share prefixes, so that prefix-cache hits happen where there is one."""
        self.admit_prompt((base[:length] + tail)[:length], salt)

    def admit_prompt(self, prompt: list[int], salt: str | None) -> None:
        promised = self.cache.can_admit(len(prompt))
        before = self.observe()
        try:
            cached = self.cache.admit(self.next_id, prompt, cache_salt=salt)
        except OutOfKVMemory:
            assert not promised and self.observe() == before
            return
        assert 0 <= cached < len(prompt)
        self.tokens[self.next_id], self.computed[self.next_id] = list(prompt), cached
        self.salts[self.next_id] = salt
        self.next_id += 1

    @precondition(lambda self: self.resident())
    @rule(data=st.data(), new=st.lists(st.integers(1, 3), min_size=1, max_size=12))
    def grow(self, data: st.DataObject, new: list[int]) -> None:
        seq_id = data.draw(st.sampled_from(self.resident()))
        if self.unchanged_on_failure(self.cache.grow, seq_id, new):
            self.tokens[seq_id] += new

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """Compute every pending token of some sequences in one step; check attention in every layer."""
        self.run_step(data)

    @precondition(lambda self: self.computed_resident())
    @rule(data=st.data())
    def decode_step(self, data: st.DataObject) -> None:
        """One more token for some fully computed sequences, all in one step: a decode step, which
        the CPU decode kernel runs alone (through the op natively, once a first one built it)."""
        chosen = data.draw(st.sets(st.sampled_from(self.computed_resident()), min_size=1))
        grown = {s for s in chosen if self.unchanged_on_failure(self.cache.grow, s, [1])}
        for seq_id in grown:
            self.tokens[seq_id].append(1)
        if grown:
            self.run_step(data, grown)

    def run_step(self, data: st.DataObject, chosen: set[int] | None = None) -> list[SeqStep]:
        if chosen is None:
            chosen = data.draw(st.sets(st.sampled_from(self.resident()), min_size=1))
        steps = [
            SeqStep(s, self.computed[s], len(self.tokens[s]) - self.computed[s])
            for s in sorted(chosen)
            if len(self.tokens[s]) > self.computed[s]
        ]
        if not steps:
            return []
        batch = StepBatch.build(steps)
        plan = self.cache.prepare(batch)
        # as a model's layers call it (through the op: natively in a kernel step), or attend() itself
        through_op = data.draw(st.booleans())
        with step_context(self.cache, plan) if through_op else nullcontext():
            for layer in range(SHAPE.num_layers):
                new = torch.cat([self.truth(s.seq_id, layer, s.context_len, s.num_cached) for s in steps], 1)
                q = torch.randn(batch.num_tokens, Q_HEADS, SHAPE.head_dim, generator=self.gen)
                k, v = new[0].contiguous(), new[1].contiguous()
                if through_op:
                    out = attention_op(q, k, v, layer, SCALE)
                else:
                    out = self.cache.attend(layer, q, k, v, plan, SCALE)
                contexts = [self.truth(s.seq_id, layer, s.context_len) for s in steps]
                ref = reference_attention(q, [c[0] for c in contexts], [c[1] for c in contexts], steps, SCALE)
                torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)
        self.cache.finish_step(plan)
        for s in steps:
            self.computed[s.seq_id] = s.context_len
            self.history = [*self.history[-15:], (tuple(self.tokens[s.seq_id]), self.salts[s.seq_id])]
        return steps

    @precondition(lambda self: self.history)
    @rule(data=st.data(), cut=st.sampled_from([32, 64, -1, -2]), tail=st.lists(st.integers(1, 3), max_size=3))
    def admit_again(self, data: st.DataObject, cut: int, tail: list[int]) -> None:
        """A prompt repeating what some sequence computed (a page-aligned part of it, or all but
        the end), with or without a tail and under its salt or none: where hits happen."""
        tokens, salt = data.draw(st.sampled_from(self.history))
        prompt = (list(tokens[:cut]) + tail)[:MAX_LEN]  # a tail on a full-length history would not fit
        if prompt:
            self.admit_prompt(prompt, data.draw(st.sampled_from([salt, None])))

    @precondition(lambda self: self.computed_resident())
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        """As the engine forks: a sample whose tokens are all computed."""
        parent = data.draw(st.sampled_from(self.computed_resident()))
        if self.unchanged_on_failure(self.cache.fork, parent, self.next_id):
            self.tokens[self.next_id] = list(self.tokens[parent])
            self.computed[self.next_id] = self.computed[parent]
            self.salts[self.next_id] = self.salts[parent]
            self.next_id += 1

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def speculative_step(self, data: st.DataObject) -> None:
        """As the engine verifies drafts: a step computes some sequences' pending tokens, then
        each keeps a prefix of what it wrote (at least one token) and drops the rest (truncate).
        Later steps write other tokens there; the attention checks then show no dropped KV is
        ever read, nor a prefix hit served from a block or page that held a dropped token."""
        for s in self.run_step(data):
            if data.draw(st.booleans()):
                self.cut(s.seq_id, data.draw(st.integers(max(1, s.num_cached), s.context_len)))

    @precondition(lambda self: any(len(self.tokens[s]) > self.computed[s] for s in self.resident()))
    @rule(data=st.data())
    def drop_reserved(self, data: st.DataObject) -> None:
        """Room grown for tokens no step wrote yet is given back (a draft that will not run)."""
        pending = [s for s in self.resident() if len(self.tokens[s]) > self.computed[s]]
        seq_id = data.draw(st.sampled_from(pending))
        self.cut(seq_id, data.draw(st.integers(max(1, self.computed[seq_id]), len(self.tokens[seq_id]))))

    def cut(self, seq_id: int, keep: int) -> None:
        self.cache.truncate(seq_id, keep)
        del self.tokens[seq_id][keep:]
        self.computed[seq_id] = min(self.computed[seq_id], keep)
        with pytest.raises(ValueError):
            self.cache.truncate(seq_id, keep + 1)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self.free_sequence(data.draw(st.sampled_from(sorted(self.tokens))))

    @precondition(lambda self: self.freed)
    @rule(data=st.data())
    def free_again(self, data: st.DataObject) -> None:
        """A sequence is freed once: a second free is an error and changes nothing."""
        before = self.observe()
        with pytest.raises(KeyError):
            self.cache.free(data.draw(st.sampled_from(self.freed)))
        assert self.observe() == before

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def preempt_by_recompute(self, data: st.DataObject) -> None:
        """The scheduler's recompute: free the sequence, admit its tokens again as a new one."""
        seq_id = data.draw(st.sampled_from(self.resident()))
        tokens, salt = self.tokens[seq_id], self.salts[seq_id]
        self.free_sequence(seq_id)
        try:
            cached = self.cache.admit(self.next_id, tokens, cache_salt=salt)
        except OutOfKVMemory:
            return
        self.tokens[self.next_id], self.computed[self.next_id] = list(tokens), cached
        self.salts[self.next_id] = salt
        self.next_id += 1

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        group = data.draw(st.lists(st.sampled_from(self.resident()), min_size=1, max_size=2, unique=True))
        self.cache.swap_out(group)
        self.swapped.update(group)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        group = data.draw(
            st.lists(st.sampled_from(sorted(self.swapped)), min_size=1, max_size=2, unique=True)
        )
        if self.unchanged_on_failure(self.cache.swap_in, group):
            self.swapped.difference_update(group)

    @rule(data=st.data())
    def reset_prefix_cache(self, data: st.DataObject) -> None:
        """Forgetting every cached prefix: what the sequences hold stays (the next step's
        attention checks it), and a prompt computed before hits nothing now."""
        capacity = self.cache.free_capacity()
        self.cache.reset_prefix_cache()
        assert self.cache.free_capacity() >= capacity
        assert self.cache.reset_prefix_cache() == 0  # nothing left to forget
        if self.history:
            tokens, salt = data.draw(st.sampled_from(self.history))
            before = self.observe()
            try:
                cached = self.cache.admit(self.next_id, list(tokens), cache_salt=salt)
            except OutOfKVMemory:
                assert self.observe() == before
                return
            assert cached == 0
            self.cache.free(self.next_id)
            self.next_id += 1

    @precondition(lambda self: isinstance(self.cache, VAttentionKVCache))
    @rule()
    def evict(self) -> None:
        """Memory pressure from outside: every kept page (idle slots, cached chunks) goes at once;
        what running sequences hold is untouched (the next step's attention checks it)."""
        self.cache.trim(force=True)
        assert self.cache.stats().units_kept == 0

    # ------------------------------------------------------------- invariants
    @invariant()
    def accounting_is_consistent(self) -> None:
        if self.cache is None:
            return
        memory, stats = self.cache.memory(), self.cache.stats()
        assert 0 <= self.cache.usage() <= 1 and self.cache.free_capacity() >= 0
        assert 0 <= memory.used_bytes <= memory.allocated_bytes <= memory.reserved_bytes
        resident_tokens = sum(len(self.tokens[s]) for s in self.resident())
        assert memory.used_bytes <= resident_tokens * SHAPE.bytes_per_token
        assert 0 <= stats.units_in_use <= min(stats.units_peak, stats.units_total)
        assert 0 <= stats.prefix_cache_hits <= stats.prefix_cache_queries

    @invariant()
    def shared_pages_are_counted(self) -> None:
        """vattention: a set's count is the slots mapping it plus the prefix index; the free list
        is exactly the sets nobody holds; the driver maps exactly the slots' pages; different
        salts never share a page."""
        cache = self.cache
        if not isinstance(cache, VAttentionKVCache):
            return
        pool, table = cache.pool, cache.table
        holders = table.mappers()
        for chunk in cache.prefix.chunks.values() if cache.prefix is not None else []:
            for s in chunk.sets:
                holders[s] = holders.get(s, 0) + 1
        assert all(pool.refcount[s] == holders.get(s, 0) for s in range(pool.num_sets))
        assert pool.free_count == sum(1 for r in pool.refcount if r == 0)
        if cache.prefix is not None:
            indexed = [s for chunk in cache.prefix.chunks.values() for s in chunk.sets]
            assert len(indexed) == len(set(indexed))  # the index holds a set in one chunk only
            # the pool's running count is the scan it replaces
            assert cache.prefix.evictable_sets() == sum(1 for s in indexed if pool.refcount[s] == 1)
        assert cache.driver.stats.pages_mapped == sum(len(s.sets) for s in table.slots) * cache.geometry.units
        pages: dict[str | None, set[int]] = {}
        for seq_id in self.resident():
            pages.setdefault(self.salts[seq_id], set()).update(table.slots[cache.seqs[seq_id].slot].sets)
        groups = list(pages.values())
        assert all(not (a & b) for i, a in enumerate(groups) for b in groups[i + 1 :])


ContractLifecycle.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_contract = ContractLifecycle.TestCase


@pytest.mark.parametrize("layout", ["paged", "contiguous", "vattention preallocated"])
def test_a_cache_backed_at_start_refuses_a_budget_beyond_available_memory(layout, monkeypatch) -> None:
    """Refused with the sizes before anything is touched, instead of killed by the OOM killer."""
    monkeypatch.setattr(host, "memory_info", lambda: (16 << 10, 1 << 30))  # 16 KiB available
    budget = 4 * MAX_LEN * SHAPE.bytes_per_token
    with pytest.raises(HostMemoryError, match="MiB available: give the KV cache a smaller budget"):
        if layout == "paged":
            PagedKVCache(SHAPE, MAX_LEN, budget)
        elif layout == "contiguous":
            ContiguousKVCache(SHAPE, MAX_LEN, budget)
        else:
            VAttentionKVCache(SHAPE, MAX_LEN, budget, page_size=PAGE, preallocate=True)


def test_an_on_demand_pool_beyond_available_memory_is_built_with_a_warning(caplog, monkeypatch) -> None:
    """vattention backs pages as sequences grow, so a larger budget may be meant; it is said."""
    monkeypatch.setattr(host, "memory_info", lambda: (16 << 10, 1 << 30))
    with caplog.at_level("WARNING", logger=budget_module.__name__):
        cache = VAttentionKVCache(SHAPE, MAX_LEN, 64 * PAGE * SHAPE.num_layers, page_size=PAGE)
    try:
        assert "larger than this machine's available memory" in caplog.text
        cache.admit(0, [1, 2, 3])  # and it works
        assert cache.memory().used_bytes == 3 * SHAPE.bytes_per_token
    finally:
        cache.close()
