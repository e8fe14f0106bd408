"""Rank 0's vattention cache: every change to its slots' pages is logged for the other ranks.

The decisions (slots, page sets, prefix hits, forks, copy-on-write, swap, reclamation,
the background mapper's look-ahead and pre-mapping) are made once, here. Its SlotMapping
tells an observer of each map, unmap and page copy, in order and by slot index; the other
ranks replay them on their own mappings, which have the same geometry, so the same set ids
land at the same virtual offsets of their own memory.
"""

from __future__ import annotations

import torch

from vmkv.dense.plan import DenseSlotPlan
from vmkv.distributed.messages import (
    CopyPages,
    HostToSlot,
    MapPages,
    PagesFromHost,
    PagesToHost,
    SlotToHost,
    UnmapPages,
    VAttentionStep,
)
from vmkv.distributed.recording import HostKeys, OpLog
from vmkv.kv_cache import StepBatch
from vmkv.vattention import VAttentionKVCache


class MappingRecorder:
    """The SlotMapping observer that logs each change as an op (vattention.mapping.MappingObserver)."""

    def __init__(self, log: OpLog) -> None:
        self.log = log
        self.hosts = HostKeys(log)

    def mapped(self, slot: int, first: int, sets: list[int]) -> None:
        self.log.add(MapPages(slot, first, sets))

    def unmapped(self, slot: int, first: int, count: int) -> None:
        self.log.add(UnmapPages(slot, first, count))

    def copied(self, src: int, dst: int, first: int, count: int) -> None:
        self.log.add(CopyPages(src, dst, first, count))

    def pages_read(self, host: torch.Tensor, slot: int, first: int, count: int) -> None:
        self.log.add(PagesToHost(self.hosts.new(host), slot, first, count))

    def pages_written(self, host: torch.Tensor, slot: int, first: int) -> None:
        self.log.add(PagesFromHost(self.hosts[host], slot, first))

    def tokens_read(self, host: torch.Tensor, slot: int, length: int) -> None:
        self.log.add(SlotToHost(self.hosts.new(host), slot, length))

    def tokens_written(self, host: torch.Tensor, slot: int) -> None:
        self.log.add(HostToSlot(self.hosts[host], slot))


class RecordingVAttentionKVCache(VAttentionKVCache):
    """VAttentionKVCache whose mapping changes and page copies are logged for the other ranks."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.log = OpLog(self._lock)  # the background mapper logs too
        with self._lock:
            # what the mapper pre-mapped since the constructor started it; from here on, each change
            for slot in self.table.slots:
                if slot.sets:
                    self.log.add(MapPages(slot.index, 0, list(slot.sets)))
            self.mapping.observer = MappingRecorder(self.log)

    def prepare(self, batch: StepBatch) -> DenseSlotPlan:
        # under the lock throughout, so no mapper job maps between the plan's readable lengths and ours
        with self._lock:
            plan = super().prepare(batch)
            slots = [self.seqs[s.seq_id].slot for s in batch.steps]
            readable = [self.geometry.tokens_backed(len(self.table.slots[i].sets)) for i in slots]
            self.log.prepared(batch, VAttentionStep(slots, readable))
        return plan
