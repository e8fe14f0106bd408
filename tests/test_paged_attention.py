"""Paged attention through prepare + attend equals the naive fp32 reference, on every path.

Blocks are handed out in shuffled order, so every sequence's context is scattered over the
pool. Tolerances: fp32 agrees with the float64 reference to 2e-5 (reduction order); bf16 is
compared with the reference run on the same bf16 values, so the only error is rounding inside
the kernel and of its output: 2e-2 absolute for O(1) values (8 mantissa bits).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from attention_reference import random_steps, reference_attention
from vmkv.paging import PagedKVCache
from vmkv.paging.attention import flash_available

from vmkv import decode_kernel
from vmkv.kv_cache import KVShape, SeqStep, StepBatch

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
PATHS = ["reference", "torch", "cpu_kernel"]


def make_cache(
    dtype: torch.dtype = torch.float32,
    attention: str = "torch",
    block_size: int = 16,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    num_blocks: int = 64,
    max_len: int = 256,
    num_layers: int = 2,
    **options: object,
) -> PagedKVCache:
    """A small cache whose free blocks come out in shuffled order."""
    shape = KVShape(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
    budget = num_blocks * block_size * shape.bytes_per_token
    cache = PagedKVCache(shape, max_len, budget, block_size=block_size, attention=attention, **options)
    cache.pool.scatter(num_blocks)
    return cache


def stored_kv(cache: PagedKVCache, seq_id: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the pool holds for a sequence's tokens, read through its block table: [n, Hkv, D] each."""
    seq = cache.seqs[seq_id]
    blocks = cache.kv[layer, seq.block_table].transpose(0, 1).flatten(1, 2)[:, : seq.num_tokens]
    return blocks[0], blocks[1]


class Runner:
    """Runs steps through a cache, keeping every sequence's K/V on the side for the reference."""

    def __init__(self, cache: PagedKVCache, num_q_heads: int, seed: int = 0) -> None:
        self.cache = cache
        self.num_q_heads = num_q_heads
        self.gen = torch.Generator().manual_seed(seed)
        layers = cache.shape.num_layers
        self.keys: list[dict[int, torch.Tensor]] = [{} for _ in range(layers)]
        self.values: list[dict[int, torch.Tensor]] = [{} for _ in range(layers)]
        self.scale = cache.shape.head_dim**-0.5

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.cache.shape.dtype).to(self.cache.device)

    def fork(self, parent: int, child: int) -> None:
        self.cache.fork(parent, child)
        for layer in range(self.cache.shape.num_layers):
            self.keys[layer][child] = self.keys[layer][parent].clone()
            self.values[layer][child] = self.values[layer][parent].clone()

    def step(self, steps: list[SeqStep]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One step on every layer; returns each layer's (attention output, reference) in fp32 on the CPU."""
        shape = self.cache.shape
        batch = StepBatch.build(steps, self.cache.device)
        plan = self.cache.prepare(batch)
        results = []
        for layer in range(shape.num_layers):
            q = self.randn(batch.num_tokens, self.num_q_heads, shape.head_dim)
            k = self.randn(batch.num_tokens, shape.num_kv_heads, shape.head_dim)
            v = self.randn(batch.num_tokens, shape.num_kv_heads, shape.head_dim)
            rows = batch.query_start.tolist()
            for i, s in enumerate(steps):
                for store, new in ((self.keys[layer], k), (self.values[layer], v)):
                    old = store.get(s.seq_id, new[:0])[: s.num_cached]
                    store[s.seq_id] = torch.cat([old, new[rows[i] : rows[i + 1]]])
            out = self.cache.attend(layer, q, k, v, plan, self.scale)
            ref = reference_attention(
                q.cpu(),
                [self.keys[layer][s.seq_id].cpu() for s in steps],
                [self.values[layer][s.seq_id].cpu() for s in steps],
                steps,
                self.scale,
            )
            results.append((out.float().cpu(), ref))
        self.cache.finish_step(plan)
        return results

    def max_error(self, steps: list[SeqStep]) -> float:
        return max((out - ref).abs().max().item() for out, ref in self.step(steps))

    def assert_stored(self, seq_id: int) -> None:
        """The pool holds exactly the K/V written for this sequence (every token some step wrote), in
        every layer."""
        for layer in range(self.cache.shape.num_layers):
            k, v = stored_kv(self.cache, seq_id, layer)
            n = self.keys[layer][seq_id].shape[0]
            assert torch.equal(k[:n], self.keys[layer][seq_id])
            assert torch.equal(v[:n], self.values[layer][seq_id])


def run_random_batch(runner: Runner, mode: str, seed: int, num_seqs: int = 6, max_len: int = 70) -> float:
    """Set up random step shapes (writing the cached part with an earlier step), then run them."""
    rng = random.Random(seed)
    steps = random_steps(rng, num_seqs, max_len, mode)
    setup = []
    for s in steps:
        tokens = [rng.randrange(50_000) for _ in range(s.context_len)]
        runner.cache.admit(s.seq_id, tokens[: s.num_cached or s.num_new])
        if s.num_cached:
            setup.append(SeqStep(s.seq_id, 0, s.num_cached))
    error = runner.max_error(setup) if setup else 0.0
    for s in steps:
        if s.num_cached:
            runner.cache.grow(s.seq_id, [rng.randrange(50_000) for _ in range(s.num_new)])
    error = max(error, runner.max_error(steps))
    for s in steps:
        runner.assert_stored(s.seq_id)
    return error


@pytest.mark.parametrize("mode", ["prefill", "decode", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("attention", PATHS)
def test_random_batches_match_reference(attention: str, dtype: torch.dtype, mode: str) -> None:
    cache = make_cache(dtype, attention)
    runner = Runner(cache, num_q_heads=6)  # GQA: 3 query heads per KV head
    seed = {"prefill": 1, "decode": 2, "mixed": 3}[mode]
    assert run_random_batch(runner, mode, seed) < TOLERANCE[dtype]
    assert cache.attention.name == attention


@pytest.mark.parametrize("attention", PATHS)
@pytest.mark.parametrize(
    ("block_size", "num_kv_heads", "num_q_heads", "head_dim"),
    [(5, 1, 1, 16), (16, 3, 9, 64), (7, 2, 8, 32), (32, 4, 4, 128)],
)
def test_shapes_and_odd_block_sizes(
    attention: str, block_size: int, num_kv_heads: int, num_q_heads: int, head_dim: int
) -> None:
    cache = make_cache(
        torch.float32,
        attention,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_blocks=200,
    )
    runner = Runner(cache, num_q_heads=num_q_heads, seed=block_size)
    assert run_random_batch(runner, "mixed", seed=block_size, num_seqs=5, max_len=60) < 5e-5


@pytest.mark.parametrize("attention", PATHS)
def test_decode_across_block_boundaries(attention: str) -> None:
    """Prefill, then decode step by step past several block boundaries, checking every step."""
    cache = make_cache(torch.bfloat16, attention, block_size=4, num_blocks=128)
    runner = Runner(cache, num_q_heads=4, seed=3)
    lengths = {0: 1, 1: 4, 2: 7}
    for seq_id, n in lengths.items():
        cache.admit(seq_id, list(range(n)))
    assert runner.max_error([SeqStep(i, 0, n) for i, n in lengths.items()]) < TOLERANCE[torch.bfloat16]
    for _ in range(13):
        for seq_id in lengths:
            cache.grow(seq_id, [1])
        steps = [SeqStep(i, n, 1) for i, n in lengths.items()]
        assert runner.max_error(steps) < TOLERANCE[torch.bfloat16]
        lengths = {i: n + 1 for i, n in lengths.items()}
    for seq_id, n in lengths.items():
        runner.assert_stored(seq_id)
        assert len(cache.seqs[seq_id].block_table) == -(-n // 4)


def test_paths_agree_on_the_same_step() -> None:
    """The fast paths give the reference path's output on identical inputs and layouts."""
    outputs = []
    for attention in PATHS:
        cache = make_cache(torch.float32, attention)
        runner = Runner(cache, num_q_heads=6, seed=11)
        run_random_batch(runner, "mixed", seed=5)
        for seq_id in range(6):
            cache.grow(seq_id, [9])
        steps = [SeqStep(i, cache.seqs[i].num_tokens - 1, 1) for i in range(6)]
        outputs.append([out for out, _ in runner.step(steps)])
    for other in outputs[1:]:
        for a, b in zip(outputs[0], other, strict=True):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=0)


@pytest.mark.skipif(
    not torch.cuda.is_available() or not flash_available(torch.device("cuda"), torch.bfloat16, 256, 64),
    reason="needs a GPU with flash-attn",
)
def test_flash_path_matches_reference() -> None:
    shape = KVShape(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    cache = PagedKVCache(shape, 1024, 32 * 256 * shape.bytes_per_token, block_size=256, device="cuda")
    assert cache.attention.name == "flash"
    runner = Runner(cache, num_q_heads=6)
    assert run_random_batch(runner, "mixed", seed=1, max_len=600) < TOLERANCE[torch.bfloat16]


def test_without_a_compiler_auto_falls_back_to_torch_and_cpu_kernel_refuses(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no kernel built earlier to fall back on
    monkeypatch.setattr(decode_kernel, "_loaded", {})
    auto = make_cache(attention="auto")
    assert run_random_batch(Runner(auto, num_q_heads=6), "decode", seed=4) < 2e-5
    assert auto.attention.name == "torch"
    strict = make_cache(attention="cpu_kernel")
    with pytest.raises(RuntimeError, match="cannot be built"):
        run_random_batch(Runner(strict, num_q_heads=6), "decode", seed=4)


def test_kept_table_rows_follow_every_table_change() -> None:
    """prepare() reads the cache's int32 rows instead of the lists: admit, growth into new
    blocks, fork, copy-on-write and swap must all keep them equal to the block tables."""
    cache = make_cache(torch.float32, "torch", block_size=4, num_blocks=40)
    runner = Runner(cache, num_q_heads=4, seed=2)
    cache.admit(0, list(range(6)))
    runner.step([SeqStep(0, 0, 6)])
    cache.fork(0, 1)
    cache.grow(1, [7])  # the shared, partly filled last block is copied for the child
    cache.grow(0, [8] * 3)  # the parent grows into a new block
    cache.swap_out([0])
    cache.swap_in([0])
    for seq_id, seq in cache.seqs.items():
        assert cache._rows[seq_id][: len(seq.block_table)].tolist() == seq.block_table
    cache.free(1)
    assert 1 not in cache._rows
