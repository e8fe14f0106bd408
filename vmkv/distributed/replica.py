"""A follower rank's KV storage: the same layout as rank 0's, driven by rank 0's decisions.

It is a plain cache of the engine's layout, built with the same budget and shape, so it has
the same blocks or slots; its own lifecycle (admit, grow, ...) is never called. Each step it
applies rank 0's ops to its storage and rebuilds the step's plan from the layout step, with
the layout's own planning code, so attention runs exactly as on rank 0.
"""

from __future__ import annotations

import torch

from vmkv.contiguous import ContiguousKVCache
from vmkv.dense.plan import decode_kernels, flash_usable, plan_step
from vmkv.distributed.messages import (
    BlocksFromHost,
    BlocksToHost,
    CopyBlock,
    CopyPages,
    CopySlot,
    DropHost,
    HostToSlot,
    KVOp,
    MapPages,
    PagedStep,
    PagesFromHost,
    PagesToHost,
    SlotToHost,
    StepMessage,
    UnmapPages,
    VAttentionStep,
)
from vmkv.kv_cache import KVCache, SeqStep, StepBatch
from vmkv.paging import PagedKVCache
from vmkv.paging.swap import copy_from_host, copy_to_host
from vmkv.vattention import VAttentionKVCache

# a follower's vattention cache maps nothing of its own accord: no mapper, pre-mapping or trimming
VATTENTION_FOLLOWER = {"background_mapping": False, "kept_idle_seconds": None, "pressure_min_available": 0.0}


class Replica:
    """Applies a StepMessage's ops to `cache` and plans its step."""

    def __init__(self, cache: KVCache) -> None:
        if not isinstance(cache, PagedKVCache | ContiguousKVCache | VAttentionKVCache):
            raise TypeError(f"tensor parallelism does not run the {cache.kv_mode} layout")
        self.cache = cache
        self.hosts: dict[int, torch.Tensor] = {}  # host copies by rank 0's key
        if isinstance(cache, VAttentionKVCache):  # its own decode kernel: plans hold its views' pointers
            config = cache.config
            self.use_flash = config.use_flash_attn and flash_usable(cache.device, cache.shape.dtype)
            self.kernels = decode_kernels(config.attention, cache.device, cache.shape, self.use_flash)

    def apply(self, ops: list[KVOp]) -> None:
        apply = self._apply_vattention if isinstance(self.cache, VAttentionKVCache) else self._apply
        for op in ops:
            apply(op)

    def plan(self, message: StepMessage) -> object:
        cache = self.cache
        batch = StepBatch.build([SeqStep(*s) for s in message.steps], cache.device)
        layout = message.layout
        if isinstance(layout, PagedStep):
            write = torch.tensor(layout.write_rows, dtype=torch.int64, device=cache.device)
            return cache.attention.plan(batch, layout.tables, write)
        if isinstance(layout, VAttentionStep):
            view = cache.mapping.k[0]
            return plan_step(
                batch, layout.slots, layout.readable, cache.device, cache.config.max_padding,
                self.use_flash, self.kernels, view,
            )  # fmt: skip
        return plan_step(
            batch, layout.slots, [cache.max_len] * len(layout.slots), cache.device, cache.max_padding
        )

    def _apply(self, op: KVOp) -> None:
        kv = self.cache.kv
        match op:
            case CopyBlock(src, dst):
                kv[:, dst].copy_(kv[:, src])
            case BlocksToHost(key, block_ids):
                self.hosts[key] = copy_to_host(kv, block_ids)
            case BlocksFromHost(key, host_blocks, block_ids):
                copy_from_host(kv, self.hosts[key], host_blocks, block_ids)
            case CopySlot(src, dst, length):
                kv[:, :, dst, :, :length] = kv[:, :, src, :, :length]
            case SlotToHost(key, slot, length):
                self.hosts[key] = kv[:, :, slot, :, :length].to("cpu", copy=True)
            case HostToSlot(key, slot):
                host = self.hosts.pop(key)
                kv[:, :, slot, :, : host.shape[-2]] = host.to(kv.device)
            case DropHost(key):
                self.hosts.pop(key, None)

    def _apply_vattention(self, op: KVOp) -> None:
        mapping = self.cache.mapping
        match op:
            case MapPages(slot, first, sets):
                mapping.map_at(slot, first, sets)
            case UnmapPages(slot, first, count):
                mapping.unmap_at(slot, first, count)
            case CopyPages(src, dst, first, count):
                mapping.copy_pages(src, dst, first, count)
            case PagesToHost(key, slot, first, count):
                self.hosts[key] = mapping.read_pages(slot, first, count)
            case PagesFromHost(key, slot, first):
                mapping.write_pages(slot, first, self.hosts[key])
            case SlotToHost(key, slot, length):
                self.hosts[key] = mapping.read_tokens(slot, length)
            case HostToSlot(key, slot):
                mapping.write_tokens(slot, self.hosts[key])
            case DropHost(key):
                self.hosts.pop(key, None)
