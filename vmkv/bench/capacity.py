"""How many concurrent sequences fit one fixed KV budget, per layout, found by doing it.

Each layout's real cache admits a sequence's prompt and grows it token by token to its
final length, then the next sequence, until the cache raises OutOfKVMemory. Nothing is
computed from formulas, so the figure includes every rounding the layout really does:
contiguous reserves max_len per sequence, paged rounds up to a block, vattention rounds
each K/V tensor of each layer (per-layer orders) or the whole sequence (layer-packed) up to a
page.

The classic example: sequences of about 100 tokens (a short prompt and an answer of about
100 tokens) under a 2,048-token maximum. Contiguous reservation holds budget / 2048 tokens
of sequences; paged with 16-token blocks holds budget / (16 * ceil(len / 16)) of them,
about 18 times as many.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vmkv.contiguous import ContiguousKVCache
from vmkv.kv_cache import KVCache, KVShape, OutOfKVMemory
from vmkv.paging import PagedKVCache
from vmkv.vattention import VAttentionKVCache
from vmkv.vattention.geometry import ORDER_NAMES, ORDERS

KIB = 1024
MIB = 1024 * KIB

# SmolLM2-135M: 30 layers, 3 KV heads of 64, bf16 -> 23,040 bytes of KV per token.
SMOLLM2_KV = KVShape(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)


@dataclass(frozen=True)
class CapacityScenario:
    """Sequences of prompt_len + an answer drawn uniformly from answer_range, under max_len."""

    shape: KVShape
    max_len: int = 2048
    prompt_len: int = 8
    answer_range: tuple[int, int] = (90, 110)
    budget_sequences: int = 8  # the budget is this many max_len sequences (contiguous capacity)
    seed: int = 0

    @property
    def budget_bytes(self) -> int:
        return self.budget_sequences * self.max_len * self.shape.bytes_per_token

    def lengths(self, count: int) -> list[tuple[int, int]]:
        """(prompt, answer) of the first `count` sequences, the same for every layout."""
        low, high = self.answer_range
        answers = np.random.default_rng(self.seed).integers(low, high + 1, size=count)
        return [(self.prompt_len, int(a)) for a in answers]


@dataclass(frozen=True)
class CapacityResult:
    layout: str
    sequences: int
    budget_bytes: int
    allocated_bytes: int  # held when full
    used_bytes: int  # bytes of tokens stored when full
    tokens: int  # tokens stored when full

    @property
    def fragmentation_bytes(self) -> int:
        return self.allocated_bytes - self.used_bytes


def fill(
    cache: KVCache, lengths: Sequence[tuple[int, int]], layout: str, budget_bytes: int
) -> CapacityResult:
    """Admit and grow sequences one after another until the cache is out of memory."""
    count = tokens = 0
    for seq_id, (prompt_len, answer_len) in enumerate(lengths):
        try:
            cache.admit(seq_id, list(range(1, prompt_len + 1)))
        except OutOfKVMemory:
            break
        try:
            for t in range(answer_len):
                cache.grow(seq_id, [t])
        except OutOfKVMemory:
            cache.free(seq_id)
            break
        count += 1
        tokens += prompt_len + answer_len
    else:
        raise ValueError(f"all {len(lengths)} sequences fit; give more so that the cache fills up")
    memory = cache.memory()
    return CapacityResult(layout, count, budget_bytes, memory.allocated_bytes, memory.used_bytes, tokens)


def layouts(
    scenario: CapacityScenario,
    max_slots: int,
    block_size: int = 16,
    page_sizes: Sequence[int] = (64 * KIB, 2 * MIB),
    vattention_orders: Sequence[str] = ORDERS,
) -> dict[str, Callable[[], KVCache]]:
    """Builders of every cache the comparison fills, each over the same budget.

    vattention gets max_slots slots: slots are only address space, so memory alone limits it.
    Its token-major order rounds each K/V tensor of a layer up to a page; head-major rounds
    each KV head's column up to a page, so it wastes up to Hkv times more; layer-packed rounds
    a sequence's one region (every layer's K and V) up to a page, 2 x layers times less.
    """
    shape, max_len, budget = scenario.shape, scenario.max_len, scenario.budget_bytes
    builders: dict[str, Callable[[], KVCache]] = {
        "contiguous": lambda: ContiguousKVCache(shape, max_len, budget),
        f"paged ({block_size}-token blocks)": lambda: PagedKVCache(
            shape, max_len, budget, block_size=block_size, enable_prefix_caching=False
        ),
    }
    for page in page_sizes:
        for order in vattention_orders:
            builders[f"vattention ({format_bytes(page)} pages, {ORDER_NAMES[order]})"] = (
                lambda page=page, order=order: VAttentionKVCache(
                    shape,
                    max_len,
                    budget,
                    page_size=page,
                    order=order,
                    max_slots=max_slots,
                    background_mapping=False,
                )
            )
    return builders


def measure_capacity(
    scenario: CapacityScenario,
    block_size: int = 16,
    page_sizes: Sequence[int] = (64 * KIB, 2 * MIB),
    vattention_orders: Sequence[str] = ORDERS,
) -> list[CapacityResult]:
    """Fill every layout; the first result is contiguous, the reference of the ratios.

    A layout whose smallest unit (one page per tensor, say) exceeds the budget holds nothing.
    """
    # More sequences than the finest layout could hold: the budget over the shortest sequence.
    shortest = scenario.prompt_len + scenario.answer_range[0]
    lengths = scenario.lengths(scenario.budget_bytes // (shortest * scenario.shape.bytes_per_token) + 2)
    results = []
    for name, build in layouts(scenario, len(lengths), block_size, page_sizes, vattention_orders).items():
        try:
            cache = build()
        except ValueError:  # the budget holds not even one allocation unit of this layout
            results.append(CapacityResult(name, 0, scenario.budget_bytes, 0, 0, 0))
            continue
        try:
            results.append(fill(cache, lengths, name, scenario.budget_bytes))
        finally:
            cache.close()
    return results


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", KIB)):
        if abs(n) >= size:
            value = n / size
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{n:.0f} B"
