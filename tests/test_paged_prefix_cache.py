"""Automatic prefix caching: hits are exact (same attention as recomputing), tenants with
different salts never share, hash collisions are detected and never hand out foreign KV,
and freed blocks stay reusable until evicted least-recently-used first."""

from __future__ import annotations

import pytest
import torch
from test_paged_attention import make_cache, stored_kv
from vmkv.paging import PagedKVCache

from vmkv import prefix_cache
from vmkv.kv_cache import SeqStep, StepBatch
from vmkv.prefix_cache import BlockKey

NUM_Q_HEADS = 4
VOCAB = 64


class ToyModel:
    """Q/K/V of a token as a fixed function of (token, position), the way a model's KV is a
    function of the prefix: whoever computes a block computes the same values."""

    def __init__(self, cache: PagedKVCache) -> None:
        gen = torch.Generator().manual_seed(0)
        s = cache.shape
        self.cache = cache
        self.emb = [
            torch.randn(VOCAB, 2 * s.num_kv_heads + NUM_Q_HEADS, s.head_dim, generator=gen) for _ in range(3)
        ]
        self.pos = torch.randn(256, 2 * s.num_kv_heads + NUM_Q_HEADS, s.head_dim, generator=gen)

    def run(self, seq_id: int, tokens: list[int], salt: str | None = None, layers: int | None = None) -> int:
        """Admit and prefill; returns how many tokens were cached. Outputs land in self.out."""
        cached = self.cache.admit(seq_id, tokens, cache_salt=salt)
        self.step([(seq_id, tokens, cached)], layers)
        return cached

    def step(self, work: list[tuple[int, list[int], int]], layers: int | None = None) -> None:
        """Compute tokens[cached:] of each (seq_id, tokens, cached) on the first `layers` layers."""
        s = self.cache.shape
        batch = StepBatch.build([SeqStep(i, c, len(t) - c) for i, t, c in work])
        plan = self.cache.prepare(batch)
        self.out = []
        for layer in range(layers or s.num_layers):
            rows = torch.cat(
                [self.emb[layer][torch.tensor(t[c:])] + self.pos[c : len(t)] for _, t, c in work]
            ).to(s.dtype)
            k, v, q = rows.split([s.num_kv_heads, s.num_kv_heads, NUM_Q_HEADS], dim=1)
            self.out.append(self.cache.attend(layer, q, k.contiguous(), v.contiguous(), plan, 0.25))
        if layers is None:  # a step cut short never finishes
            self.cache.finish_step(plan)


def last_rows(model: ToyModel) -> list[torch.Tensor]:
    return [o[-1] for o in model.out]


@pytest.mark.parametrize("attention", ["reference", "torch", "cpu_kernel"])
@pytest.mark.parametrize("prompt_len", [37, 32])  # a partial hit; the whole prompt cached
def test_a_hit_gives_the_attention_of_recomputing(attention: str, prompt_len: int) -> None:
    prefix = [(7 * i) % VOCAB for i in range(prompt_len)]
    cached = make_cache(block_size=8, attention=attention)
    model = ToyModel(cached)
    model.run(0, prefix[:33])  # computes (and caches) the first 4 full blocks
    assert model.run(1, prefix) == min(32, prompt_len - 1)

    fresh = make_cache(block_size=8, attention=attention, enable_prefix_caching=False)
    recompute = ToyModel(fresh)
    assert recompute.run(0, prefix) == 0
    for a, b in zip(last_rows(model), last_rows(recompute), strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0)
    for layer in range(2):
        for a, b in zip(stored_kv(cached, 1, layer), stored_kv(fresh, 0, layer), strict=True):
            torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_hits_share_blocks_and_are_counted() -> None:
    cache = make_cache(block_size=8)
    model = ToyModel(cache)
    prompt = list(range(20))  # 2 full blocks + 4 tokens
    model.run(0, prompt)
    assert model.run(1, prompt + [60, 61]) == 16
    t0, t1 = cache.seqs[0].block_table, cache.seqs[1].block_table
    assert t0[:2] == t1[:2] and t0[2] != t1[2]
    assert [cache.pool.blocks[b].ref_count for b in t1] == [2, 2, 1]
    c = cache.stats()
    assert (c.prefix_cache_queries, c.prefix_cache_hits) == (20 + 22, 16)
    assert (c.prefix_cache_query_blocks, c.prefix_cache_hit_blocks) == (2 + 2, 2)
    assert c.hash_collisions == 0


def test_whole_prompt_hit_recomputes_the_last_token_in_a_private_copy() -> None:
    cache = make_cache(block_size=8)
    model = ToyModel(cache)
    prompt = list(range(16))
    model.run(0, prompt)
    before = [t.clone() for t in stored_kv(cache, 0, 1)]
    assert model.run(1, prompt) == 15
    t0, t1 = cache.seqs[0].block_table, cache.seqs[1].block_table
    assert t0[0] == t1[0] and t0[1] != t1[1]  # the last block is a copy: its last token is written again
    assert cache.stats().cow_copies == 1
    for a, b in zip(before, stored_kv(cache, 0, 1), strict=True):
        assert torch.equal(a, b)
    cache.free(0)
    cache.free(1)
    assert model.run(2, prompt) == 15  # the original stayed cached; the copy was a duplicate


def test_without_a_block_for_the_copy_the_last_block_is_recomputed() -> None:
    cache = make_cache(block_size=4, num_blocks=2)
    model = ToyModel(cache)
    model.run(0, list(range(8)))
    cache.free(0)  # both blocks cached and free: none left over for a private copy
    assert model.run(1, list(range(8))) == 4
    assert cache.stats().cow_copies == 0


def test_blocks_are_cached_only_once_the_last_layer_wrote_them() -> None:
    cache = make_cache(block_size=8)
    model = ToyModel(cache)
    prompt = list(range(24))
    # admitted in the same step as the sequence that computes the blocks: no reuse
    assert cache.admit(0, prompt) == 0
    assert cache.admit(1, prompt) == 0
    model.step([(0, prompt, 0), (1, prompt, 0)], layers=1)  # layer 0 only: not computed yet
    assert cache.admit(2, prompt) == 0
    cache.free(2)
    model.step([(0, prompt, 0), (1, prompt, 0)])  # now every layer
    assert cache.admit(3, prompt) == 23
    assert len(cache.pool.cached) == 3  # the duplicate copies were not indexed twice


def test_decode_tokens_complete_cacheable_blocks() -> None:
    cache = make_cache(block_size=4)
    model = ToyModel(cache)
    tokens = list(range(6))
    model.run(0, tokens)
    for t in (40, 41, 42):
        cache.grow(0, [t])
        model.step([(0, tokens + [t], len(tokens))])
        tokens = tokens + [t]
    assert cache.admit(1, tokens + [50]) == 8  # the block completed by decoding is reused


def test_different_salts_never_share() -> None:
    cache = make_cache(block_size=8)
    model = ToyModel(cache)
    prompt = list(range(30))
    model.run(0, prompt, salt="tenant-a")
    assert cache.admit(1, prompt, cache_salt="tenant-b") == 0
    assert cache.admit(2, prompt) == 0
    assert cache.admit(3, prompt, cache_salt="tenant-a") == 24
    tokens = list(range(8))
    assert prefix_cache.hash_block(None, tokens, ("model-a", None)) != prefix_cache.hash_block(
        None, tokens, ("model-b", None)
    )


def test_a_forced_hash_collision_is_detected_and_never_shared(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefix_cache, "hash_block", lambda parent, tokens, identity: 42)
    cache = make_cache(block_size=8)
    model = ToyModel(cache)
    a = list(range(16))
    model.run(0, a)  # block 0 indexed under 42; block 1 (also 42, other prefix) is not
    assert cache.stats().hash_collisions == 1
    b = [t + 1 for t in a]
    assert model.run(1, b) == 0  # same hash, different tokens: a miss, not A's KV
    assert cache.stats().hash_collisions >= 2
    fresh = ToyModel(make_cache(block_size=8, enable_prefix_caching=False))
    fresh.run(0, b)
    for x, y in zip(last_rows(model), last_rows(fresh), strict=True):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=0)
    assert model.run(2, a + [3]) == 8  # the genuine entry still hits


def test_keys_compare_whole_prefixes() -> None:
    ident = ("m", None)
    root_a = BlockKey(None, (1, 2), ident)
    root_b = BlockKey(None, (9, 9), ident)
    child = BlockKey(root_a, (3, 4), ident)
    assert child.matches(root_a, [3, 4], ident)
    assert child.matches(BlockKey(None, (1, 2), ident), [3, 4], ident)  # equal prefix, another object
    assert not child.matches(root_b, [3, 4], ident)  # same tokens after a different prefix
    assert not child.matches(root_a, [3, 5], ident)
    assert not child.matches(root_a, [3, 4], ("m", "salt"))
    assert not child.matches(None, [3, 4], ident)


def test_freed_blocks_stay_cached_until_needed_then_the_oldest_tail_goes_first() -> None:
    cache = make_cache(block_size=4, num_blocks=6)
    model = ToyModel(cache)
    a = list(range(12))  # 3 full blocks
    model.run(0, a)
    cache.free(0)
    c = cache.stats()
    assert (c.units_in_use, c.blocks_cached_free) == (0, 3)
    cache.admit(1, list(range(30, 42)))  # 3 plain free blocks are used first: no eviction
    assert cache.stats().prefix_cache_evictions == 0
    cache.grow(1, [1])  # one more block: evicts the least recently freed, a's last block
    assert cache.stats().prefix_cache_evictions == 1
    cache.free(1)
    assert cache.admit(2, a + [5]) == 8


def test_prefix_caching_can_be_turned_off() -> None:
    cache = make_cache(block_size=4, enable_prefix_caching=False)
    model = ToyModel(cache)
    model.run(0, list(range(12)))
    assert cache.admit(1, list(range(12))) == 0
    assert not cache.pool.cached and cache.stats().prefix_cache_queries == 0
