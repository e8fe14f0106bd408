"""Random lifecycles (admit, grow, batched decode, fork, free, evict, swap) keep the block
accounting exact and every sequence's KV intact.

K/V of a token are a fixed function of (cache identity, prefix), as a model's are, so the
pool must always hold, for every running sequence, exactly the values of its own prefix:
this catches a copy-on-write that lets one sequence write into another's block, a prefix
hit that hands out the wrong KV, and a swap that brings back the wrong block. A second run
replaces the hash with one that collides constantly; nothing may change but the hit rate.
"""

from __future__ import annotations

import functools
import hashlib

import torch
from attention_reference import reference_attention
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_paged_attention import stored_kv
from vmkv.paging import PagedKVCache, prefix_cache

from vmkv.kv_cache import KVShape, OutOfKVMemory, SeqStep, SequenceTooLong, StepBatch

SHAPE = KVShape(num_layers=1, num_kv_heads=1, head_dim=16, dtype=torch.float32)  # the CPU kernel runs
BLOCK_SIZE, NUM_BLOCKS, MAX_LEN, Q_HEADS = 4, 12, 32, 2
SCALE = 0.5


@functools.cache
def kv_of(identity: tuple, prefix: tuple[int, ...]) -> torch.Tensor:
    """[2, Hkv, D]: the K and V of the last token of prefix."""
    seed = int.from_bytes(
        hashlib.blake2b(repr((identity, prefix)).encode(), digest_size=8).digest(), "little"
    )
    return torch.randn(2, SHAPE.num_kv_heads, SHAPE.head_dim, generator=torch.Generator().manual_seed(seed))


class PagedLifecycle(RuleBasedStateMachine):
    scatter = True  # blocks in random order: tables with no two blocks in a row

    def __init__(self) -> None:
        super().__init__()
        budget = NUM_BLOCKS * BLOCK_SIZE * SHAPE.bytes_per_token
        self.cache = PagedKVCache(SHAPE, MAX_LEN, budget, block_size=BLOCK_SIZE, model_id="m")
        if self.scatter:
            self.cache.pool.scatter(0)
        self.tokens: dict[int, list[int]] = {}
        self.salt: dict[int, str | None] = {}
        self.swapped: set[int] = set()
        self.next_id = 0
        self.gen = torch.Generator().manual_seed(0)

    # ---------------------------------------------------------------- helpers
    @property
    def running(self) -> list[int]:
        return sorted(set(self.tokens) - self.swapped)

    def snapshot(self) -> tuple:
        pool = self.cache.pool
        return (
            [b.ref_count for b in pool.blocks],
            sorted(pool.plain_free),
            list(pool.cached_free),
            {i: list(s.block_table) for i, s in self.cache.seqs.items()},
        )

    def truth(self, seq_id: int, n: int) -> torch.Tensor:
        """[2, n, Hkv, D]: what the first n tokens' K/V must be."""
        identity, tokens = ("m", self.salt[seq_id]), self.tokens[seq_id]
        return torch.stack([kv_of(identity, tuple(tokens[: p + 1])) for p in range(n)], dim=1)

    def step(self, work: list[tuple[int, int]]) -> None:
        """Compute tokens num_cached.. of each (seq_id, num_cached) and check the attention."""
        steps = [SeqStep(i, c, len(self.tokens[i]) - c) for i, c in work]
        batch = StepBatch.build(steps)
        plan = self.cache.prepare(batch)
        new = torch.cat([self.truth(s.seq_id, s.context_len)[:, s.num_cached :] for s in steps], dim=1)
        q = torch.randn(batch.num_tokens, Q_HEADS, SHAPE.head_dim, generator=self.gen)
        out = self.cache.attend(0, q, new[0], new[1], plan, SCALE)
        self.cache.finish_step(plan)
        contexts = [self.truth(s.seq_id, s.context_len) for s in steps]
        ref = reference_attention(q, [c[0] for c in contexts], [c[1] for c in contexts], steps, SCALE)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)

    # ------------------------------------------------------------------ rules
    @rule(
        base=st.sampled_from([[0] * 12, [1, 2] * 6, [2, 1, 0] * 4]),
        tail=st.lists(st.integers(0, 2), max_size=4),
        length=st.integers(1, 14),
        salt=st.sampled_from([None, "s"]),
    )
    def admit(self, base: list[int], tail: list[int], length: int, salt: str | None) -> None:
        """Prompts share prefixes often, so that hits, duplicates and evictions happen."""
        prompt = (base[:length] + tail)[:length]
        seq_id, before = self.next_id, self.snapshot()
        try:
            cached = self.cache.admit(seq_id, prompt, cache_salt=salt)
        except OutOfKVMemory:
            assert self.snapshot() == before
            return
        assert 0 <= cached < len(prompt)
        self.next_id += 1
        self.tokens[seq_id], self.salt[seq_id] = list(prompt), salt
        self.step([(seq_id, cached)])

    @precondition(lambda self: self.running)
    @rule(data=st.data(), new=st.lists(st.integers(3, 10**6), min_size=1, max_size=5))
    def grow(self, data: st.DataObject, new: list[int]) -> None:
        seq_id = data.draw(st.sampled_from(self.running))
        before, n = self.snapshot(), len(self.tokens[seq_id])
        try:
            self.cache.grow(seq_id, new)
        except (OutOfKVMemory, SequenceTooLong):
            assert self.snapshot() == before
            return
        self.tokens[seq_id] += new
        self.step([(seq_id, n)])

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def decode_batch(self, data: st.DataObject) -> None:
        chosen = data.draw(st.lists(st.sampled_from(self.running), min_size=1, unique=True))
        work = []
        for seq_id in chosen:
            token = data.draw(st.integers(3, 10**6))
            try:
                self.cache.grow(seq_id, [token])
            except (OutOfKVMemory, SequenceTooLong):
                continue
            self.tokens[seq_id].append(token)
            work.append((seq_id, len(self.tokens[seq_id]) - 1))
        if work:
            self.step(work)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self.running))
        child = self.next_id
        self.next_id += 1
        self.cache.fork(parent, child)
        self.tokens[child], self.salt[child] = list(self.tokens[parent]), self.salt[parent]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.cache.free(seq_id)
        del self.tokens[seq_id], self.salt[seq_id]
        self.swapped.discard(seq_id)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        group = data.draw(st.lists(st.sampled_from(self.running), min_size=1, unique=True))
        self.cache.swap_out(group)
        self.swapped.update(group)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        group = data.draw(st.lists(st.sampled_from(sorted(self.swapped)), min_size=1, unique=True))
        before = self.snapshot()
        try:
            self.cache.swap_in(group)
        except OutOfKVMemory:
            assert self.snapshot() == before
            return
        self.swapped.difference_update(group)

    # ------------------------------------------------------------- invariants
    @invariant()
    def counts_are_exact_and_a_block_is_free_exactly_at_zero(self) -> None:
        pool = self.cache.pool
        held = [0] * pool.num_blocks
        for seq_id in self.running:
            for b in self.cache.seqs[seq_id].block_table:
                held[b] += 1
        assert [b.ref_count for b in pool.blocks] == held
        free = set(pool.plain_free) | set(pool.cached_free)
        assert len(free) == len(pool.plain_free) + len(pool.cached_free) == pool.num_free
        assert free == {b.block_id for b in pool.blocks if b.ref_count == 0}
        assert all(pool.blocks[b].block_hash is None for b in pool.plain_free)
        assert all(pool.cached[b.block_hash] is b for b in pool.blocks if b.block_hash is not None)
        assert len(pool.cached) == sum(b.block_hash is not None for b in pool.blocks)

    @invariant()
    def every_running_sequence_holds_exactly_its_own_kv(self) -> None:
        for seq_id in self.running:
            n = len(self.tokens[seq_id])
            seq = self.cache.seqs[seq_id]
            assert len(seq.block_table) == -(-n // BLOCK_SIZE) and seq.num_computed == n
            k, v = stored_kv(self.cache, seq_id, 0)
            assert torch.equal(torch.stack([k, v]), self.truth(seq_id, n))

    def teardown(self) -> None:
        for seq_id in list(self.tokens):
            self.cache.free(seq_id)
        pool = self.cache.pool
        assert pool.num_free == pool.num_blocks and all(b.ref_count == 0 for b in pool.blocks)


class RunKeepingLifecycle(PagedLifecycle):
    """The same lifecycles with the pool's default placement (blocks kept in runs)."""

    scatter = False


class CollidingLifecycle(PagedLifecycle):
    """The same lifecycles under a hash that collides on almost every block."""

    def __init__(self) -> None:
        super().__init__()
        self._hash = prefix_cache.hash_block
        prefix_cache.hash_block = lambda parent, tokens, identity: sum(tokens) % 3

    def teardown(self) -> None:
        prefix_cache.hash_block = self._hash
        super().teardown()


SETTINGS = settings(
    max_examples=20, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestPagedLifecycle = PagedLifecycle.TestCase
TestPagedLifecycle.settings = SETTINGS
TestRunKeepingLifecycle = RunKeepingLifecycle.TestCase
TestRunKeepingLifecycle.settings = SETTINGS
TestCollidingLifecycle = CollidingLifecycle.TestCase
TestCollidingLifecycle.settings = SETTINGS
