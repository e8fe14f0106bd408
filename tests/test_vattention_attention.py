"""Attention through prepare + attend equals the naive fp32 reference, for both dense-slot caches.

Tolerances: fp32 inputs agree with the float64 reference to 2e-5 (kernel reduction order);
bf16 inputs are compared with the reference run on the same bf16 values, so the only
error is bf16 rounding inside the kernel and of its output: 2e-2 absolute (values are
O(1), bf16 keeps 8 mantissa bits, ~4e-3 relative per rounding).
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from attention_reference import random_steps, reference_attention

from vmkv import decode_kernel
from vmkv.contiguous import ContiguousKVCache
from vmkv.decode_kernel import load_decode_kernel
from vmkv.kv_cache import KVCache, KVShape, SeqStep, StepBatch
from vmkv.vattention import VAttentionKVCache

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
NUM_Q_HEADS = 6  # GQA: 3 query heads per KV head
MAX_LEN = 160


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_cache(kind: str, dtype: torch.dtype) -> KVCache:
    shape = KVShape(num_layers=2, num_kv_heads=2, head_dim=16, dtype=dtype)
    budget = 16 * MAX_LEN * shape.bytes_per_token
    if kind == "contiguous":
        return ContiguousKVCache(shape, MAX_LEN, budget)
    order, _, extra = kind.partition("-")
    return VAttentionKVCache(
        shape,
        MAX_LEN,
        4 * budget,
        page_size=4096,
        order=order.removeprefix("va_"),
        combined_reservation=extra == "combined",
        background_mapping=extra != "sync",
        attention="sdpa" if extra == "sdpa" else "auto",
    )


class Driver:
    """Runs steps on a cache while keeping every sequence's K/V on the side for the reference."""

    def __init__(self, cache: KVCache, seed: int) -> None:
        self.cache = cache
        self.gen = torch.Generator().manual_seed(seed)
        self.keys: dict[int, list[torch.Tensor]] = {}
        self.values: dict[int, list[torch.Tensor]] = {}

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.cache.shape.dtype).to(self.cache.device)

    def step(self, steps: list[SeqStep]) -> list[float]:
        """One step through prepare + attend on every layer; returns the max error per layer."""
        shape = self.cache.shape
        batch = StepBatch.build(steps)
        plan = self.cache.prepare(batch)
        errors = []
        for layer in range(shape.num_layers):
            q = self.randn(batch.num_tokens, NUM_Q_HEADS, shape.head_dim)
            k = self.randn(batch.num_tokens, shape.num_kv_heads, shape.head_dim)
            v = self.randn(batch.num_tokens, shape.num_kv_heads, shape.head_dim)
            rows = batch.query_start.tolist()
            for i, s in enumerate(steps):
                old_k = self.keys.setdefault(s.seq_id, [k[:0]] * shape.num_layers)[layer][: s.num_cached]
                old_v = self.values.setdefault(s.seq_id, [v[:0]] * shape.num_layers)[layer][: s.num_cached]
                self.keys[s.seq_id][layer] = torch.cat([old_k, k[rows[i] : rows[i + 1]]])
                self.values[s.seq_id][layer] = torch.cat([old_v, v[rows[i] : rows[i + 1]]])
            scale = 1 / math.sqrt(shape.head_dim)
            out = self.cache.attend(layer, q, k, v, plan, scale)
            ref = reference_attention(
                q.cpu(),
                [self.keys[s.seq_id][layer].cpu() for s in steps],
                [self.values[s.seq_id][layer].cpu() for s in steps],
                steps,
                scale,
            )
            errors.append((out.float().cpu() - ref).abs().max().item())
        self.cache.finish_step(plan)
        return errors

    def run(self, steps: list[SeqStep]) -> list[float]:
        """Write each sequence's cached part in a first step, then run `steps` and compare."""
        history = [SeqStep(s.seq_id, 0, s.num_cached) for s in steps if s.num_cached]
        for s in steps:
            self.cache.admit(s.seq_id, [1] * (s.num_cached or s.num_new))
        if history:
            self.step(history)
            for s in steps:
                if s.num_cached:
                    self.cache.grow(s.seq_id, [1] * s.num_new)
        return self.step(steps)


KINDS = [
    "contiguous",
    "va_token",
    "va_head",
    "va_token-sdpa",
    "va_head-sdpa",
    "va_token-combined",
    "va_head-sync",
    "va_packed",
    "va_packed-sdpa",
    "va_packed-combined",
]
# decodes batched into SDPA groups
SDPA_KINDS = ["contiguous", "va_token-sdpa", "va_head-sdpa", "va_packed-sdpa"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["prefill", "decode", "mixed"])
@pytest.mark.parametrize("kind", KINDS)
def test_attention_matches_reference(kind: str, mode: str, dtype: torch.dtype) -> None:
    for seed in range(2):
        cache = make_cache(kind, dtype)
        try:
            steps = random_steps(random.Random(seed), num_seqs=7, max_len=MAX_LEN, mode=mode)
            errors = Driver(cache, seed).run(steps)
        finally:
            cache.close()
        assert max(errors) < TOLERANCE[dtype], (kind, mode, seed, errors)


@pytest.mark.parametrize("kind", SDPA_KINDS)
def test_decode_steps_batch_consecutive_slots_and_stay_exact(kind: str) -> None:
    """Several decode steps in a row: sequences of similar length share one batched call."""
    cache = make_cache(kind, torch.float32)
    driver = Driver(cache, 0)
    lengths = [40, 44, 47, 50, 41, 38]
    errors = driver.run([SeqStep(i, n, 1) for i, n in enumerate(lengths)])
    for t in range(1, 4):
        for i in range(len(lengths)):
            cache.grow(i, [1])
        steps = [SeqStep(i, n + t, 1) for i, n in enumerate(lengths)]
        plan = cache.prepare(StepBatch.build(steps))
        grouped = sum(g.num_slots for g in plan.groups)
        # packed pages hold 8 tokens here (32 token-major): one pad page cannot always bring
        # the shortest slots to the group's longest context, so some decode alone
        assert plan.groups and grouped >= (2 if "packed" in kind else len(lengths))
        errors += driver.step(steps)
    cache.close()
    assert max(errors) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("pad", [0, 1])
def test_decode_group_reads_only_mapped_memory(pad: int) -> None:
    """A batched decode reads every slot up to the group's longest context: all of it must be mapped."""
    shape = KVShape(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    cache = VAttentionKVCache(
        shape,
        MAX_LEN,
        1 << 20,
        page_size=4096,
        background_mapping=False,
        group_pad_pages=pad,
        attention="sdpa",
    )
    driver = Driver(cache, 1)
    lengths = [3, 30, 31, 33, 64, 65, 100, 20]  # pages hold 32 tokens: groups must split at page ends
    driver.run([SeqStep(i, n, 1) for i, n in enumerate(lengths)])
    for i in range(len(lengths)):
        cache.grow(i, [1])
    plan = cache.prepare(StepBatch.build([SeqStep(i, n + 1, 1) for i, n in enumerate(lengths)]))
    geo, drv = cache.geometry, cache.driver
    assert plan.groups
    for g in plan.groups:
        for slot in range(g.first_slot, g.first_slot + g.num_slots):
            for res, base in cache.mapping.placed:
                offset = base + geo.page_offset(slot, 0, 0)
                assert drv.is_mapped(res, offset, g.max_len * geo.column_token_bytes)
    cache.close()


@pytest.mark.parametrize("order", ["token", "head", "packed"])
def test_kernel_decodes_every_slot_in_one_call_without_padding_pages(order: str) -> None:
    """The kernel reads each slot only up to its own length: one call for all decodes, any
    slot order or length spread, and no surplus pages mapped for grouping."""
    shape = KVShape(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    cache = VAttentionKVCache(shape, MAX_LEN, 1 << 20, page_size=4096, background_mapping=False, order=order)
    if cache._kernels is None or load_decode_kernel(torch.float32, NUM_Q_HEADS // 2, 16) is None:
        pytest.skip("no C compiler here")
    driver = Driver(cache, 2)
    lengths = [3, 30, 31, 33, 64, 65, 100, 20]
    errors = driver.run([SeqStep(i, n, 1) for i, n in enumerate(lengths)])
    pages = cache.stats().pages_mapped
    for i in range(len(lengths)):
        cache.grow(i, [1])
    steps = [SeqStep(i, n + 1, 1) for i, n in enumerate(lengths)]
    plan = cache.prepare(StepBatch.build(steps))
    assert plan.kernel_decode is not None and not plan.groups and not plan.singles
    assert cache.stats().group_pad_page_sets == 0
    errors += driver.step(steps)
    assert cache.stats().pages_mapped <= pages + len(lengths) * cache.geometry.units
    cache.close()
    assert max(errors) < TOLERANCE[torch.float32]


def test_attention_is_selectable_and_checked() -> None:
    shape = KVShape(num_layers=1, num_kv_heads=1, head_dim=16, dtype=torch.float32)
    sdpa = VAttentionKVCache(shape, MAX_LEN, 1 << 20, page_size=4096, attention="sdpa")
    assert sdpa._kernels is None
    sdpa.close()
    with pytest.raises(ValueError, match="attention must be one of"):
        VAttentionKVCache(shape, MAX_LEN, 1 << 20, page_size=4096, attention="flash-ish")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (CudaDriver, SDPA or flash-attn)")
@pytest.mark.parametrize("mode", ["prefill", "decode", "mixed"])
def test_attention_on_gpu_matches_reference(mode: str) -> None:
    shape = KVShape(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    cache = VAttentionKVCache(shape, MAX_LEN, 256 << 20, "cuda")
    try:
        steps = random_steps(random.Random(0), num_seqs=7, max_len=MAX_LEN, mode=mode)
        errors = Driver(cache, 0).run(steps)
    finally:
        cache.close()
    assert max(errors) < TOLERANCE[torch.bfloat16], errors


def test_without_a_compiler_auto_falls_back_to_sdpa_and_cpu_kernel_refuses(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no kernel built earlier to fall back on
    monkeypatch.setattr(decode_kernel, "_loaded", {})
    auto = make_cache("va_head", torch.float32)
    steps = [SeqStep(i, n, 1) for i, n in enumerate([5, 40, 41])]
    assert max(Driver(auto, 3).run(steps)) < TOLERANCE[torch.float32]  # this step: one call per decode
    assert auto.prepare(StepBatch.build(steps)).kernel_decode is None  # later steps: SDPA groups
    auto.close()
    shape = KVShape(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    strict = VAttentionKVCache(shape, MAX_LEN, 1 << 20, page_size=4096, attention="cpu_kernel")
    with pytest.raises(RuntimeError, match="cannot be built"):
        Driver(strict, 3).run(steps)
    strict.close()
