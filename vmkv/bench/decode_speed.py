"""Decode-attention speed of each vattention order, measured beside capacity in the same run:
the layout choice trades one against the other (docs/vattention.md), so both are measured.

Each order's real cache holds `batch` sequences of `context` tokens in every layer, and one
decode step attends every layer in turn, as an engine step does: a layer's K/V is then read
from memory, not from a cache that a one-layer loop would keep warm. The orders' steps are
interleaved round by round and each keeps its best round, so load from other work on the
machine falls on all of them alike and only ever adds time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vmkv.drivers import DEFAULT_PAGE_SIZE
from vmkv.kv_cache import KVShape, SeqStep, StepBatch
from vmkv.vattention import VAttentionKVCache
from vmkv.vattention.geometry import ORDERS, SlotGeometry


@dataclass(frozen=True)
class DecodeSpeed:
    order: str
    attention: str  # the cache's decode path: "cpu_kernel", "sdpa" or "auto"
    page_size: int
    context: int
    batch: int
    ms_per_layer: float  # best round's step time over the layers


def measure_decode_speed(
    shape: KVShape,
    context: int = 2048,
    batch: int = 8,
    orders: Sequence[str] = ORDERS,
    attentions: Sequence[str] = ("cpu_kernel", "sdpa"),
    page_size: int = DEFAULT_PAGE_SIZE,
    rounds: int = 10,
    device: torch.device | str = "cpu",
    num_q_heads: int | None = None,
) -> list[DecodeSpeed]:
    """One decode step of `batch` sequences at `context` tokens, per order and decode path."""
    results = []
    q_heads = num_q_heads or 3 * shape.num_kv_heads
    for attention in attentions:
        caches = {
            order: _filled_cache(shape, context, batch, order, attention, page_size, device)
            for order in orders
        }
        try:
            gen = torch.Generator().manual_seed(0)
            q = torch.randn(batch, q_heads, shape.head_dim, generator=gen).to(device, shape.dtype)
            kv = torch.randn(batch, shape.num_kv_heads, shape.head_dim, generator=gen).to(device, shape.dtype)
            plans = {
                order: cache.prepare(StepBatch.build([SeqStep(i, context, 1) for i in range(batch)]))
                for order, cache in caches.items()
            }
            best = dict.fromkeys(caches, float("inf"))
            for round_ in range(rounds + 1):  # round 0 warms up (kernel builds, first touches)
                for order, cache in caches.items():
                    seconds = _step_seconds(cache, q, kv, plans[order], torch.device(device))
                    if round_:
                        best[order] = min(best[order], seconds)
            for order, seconds in best.items():
                ms = seconds / shape.num_layers * 1e3
                results.append(DecodeSpeed(order, attention, page_size, context, batch, ms))
        finally:
            for cache in caches.values():
                cache.close()
    return results


def _filled_cache(
    shape: KVShape,
    context: int,
    batch: int,
    order: str,
    attention: str,
    page_size: int,
    device: torch.device | str,
) -> VAttentionKVCache:
    """A cache of exactly `batch` slots holding `context` tokens each, plus room for one more."""
    geo = SlotGeometry(shape, context + 1, batch, page_size, order)
    cache = VAttentionKVCache(
        shape,
        context + 1,
        batch * geo.pages_for(context + 1) * geo.page_set_bytes,
        device,
        page_size=page_size,
        order=order,
        attention=attention,
        max_slots=batch,
        background_mapping=False,
        group_pad_pages=0,
        kept_idle_seconds=None,
    )
    rows = torch.randn(
        context, shape.num_kv_heads, shape.head_dim, generator=torch.Generator().manual_seed(1)
    )
    rows = rows.to(device, shape.dtype)
    for seq in range(batch):
        cache.admit(seq, [1] * context)
        slot = cache.seqs[seq].slot
        for view in cache.mapping.tensors():
            view[slot, :context] = rows
        cache.grow(seq, [1])
    return cache


def _step_seconds(
    cache: VAttentionKVCache, q: torch.Tensor, kv: torch.Tensor, plan: object, device: torch.device
) -> float:
    t0 = time.perf_counter()
    for layer in range(cache.shape.num_layers):
        cache.attend(layer, q, kv, kv, plan, 0.125)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0
