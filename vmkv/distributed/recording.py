"""Rank 0's caches: the engine's layouts, recording what the other ranks must repeat.

The KV manager runs once, on rank 0: every decision (which blocks or slots, prefix hits,
copy-on-write, swap, preemption) is made here. What the other ranks need from it is where
the step's tokens go (the layout step, taken at prepare) and every change of KV contents
made outside a step's attention (the ops, in order): they apply both to their own storage,
which holds the same blocks or slots for their own KV heads.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext

import torch

from vmkv.contiguous import ContiguousKVCache
from vmkv.dense.plan import DenseSlotPlan
from vmkv.distributed.messages import (
    BlocksFromHost,
    BlocksToHost,
    CopyBlock,
    CopySlot,
    DropHost,
    HostToSlot,
    KVOp,
    PagedStep,
    SlotStep,
    SlotToHost,
    VAttentionStep,
)
from vmkv.kv_cache import StepBatch
from vmkv.paging import PagedKVCache
from vmkv.paging.attention import PagedPlan


class OpLog:
    """The ops since the last step, and the layout step of the latest prepare.

    lock: the cache's, where another thread (vattention's background mapper) logs ops too;
    add() and take() hold it, so no op lands in a list already sent.
    """

    def __init__(self, lock: AbstractContextManager[object] | None = None) -> None:
        self.ops: list[KVOp] = []
        self.steps: list[tuple[int, int, int]] = []
        self.step: PagedStep | SlotStep | VAttentionStep | None = None
        self._next_key = 0
        self._lock = lock or nullcontext()

    def add(self, op: KVOp) -> None:
        with self._lock:
            self.ops.append(op)

    def prepared(self, batch: StepBatch, step: PagedStep | SlotStep | VAttentionStep) -> None:
        self.steps = [(s.seq_id, s.num_cached, s.num_new) for s in batch.steps]
        self.step = step

    def new_key(self) -> int:
        self._next_key += 1
        return self._next_key

    def take(self) -> tuple[list[KVOp], list[tuple[int, int, int]], PagedStep | SlotStep | VAttentionStep]:
        """The ops to apply before this step's forward, the step's (seq_id, num_cached, num_new)
        and its layout step; the log starts again."""
        with self._lock:
            if self.step is None:
                raise RuntimeError("a forward ran without its cache's prepare")
            taken = self.ops, self.steps, self.step
            self.ops, self.step = [], None
        return taken


class HostKeys:
    """Keys for rank 0's host copies: each gets one when made, and its drop is logged when
    rank 0's tensor dies (the other ranks keep theirs exactly as long)."""

    def __init__(self, log: OpLog) -> None:
        self.log = log
        self._keys: dict[int, int] = {}  # id(host tensor) -> key, while the tensor lives

    def new(self, host: torch.Tensor) -> int:
        key = self.log.new_key()
        self._keys[id(host)] = key
        weakref.finalize(host, self._dropped, id(host), key)
        return key

    def __getitem__(self, host: torch.Tensor) -> int:
        return self._keys[id(host)]

    def _dropped(self, host_id: int, key: int) -> None:
        self._keys.pop(host_id, None)
        self.log.add(DropHost(key))


class RecordingPagedKVCache(PagedKVCache):
    """PagedKVCache whose block copies and swaps are logged for the other ranks."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.log = OpLog()
        self._hosts = HostKeys(self.log)

    def prepare(self, batch: StepBatch) -> PagedPlan:
        plan = super().prepare(batch)
        tables = [list(self.seqs[s.seq_id].block_table) for s in batch.steps]
        self.log.prepared(batch, PagedStep(tables, plan.write_rows.tolist()))
        return plan

    def _copy_block(self, src: int, dst: int) -> None:
        super()._copy_block(src, dst)
        self.log.ops.append(CopyBlock(src, dst))

    def _to_host(self, block_ids: list[int]) -> torch.Tensor:
        host = super()._to_host(block_ids)
        # the host copy lives as long as a swapped sequence refers to it; so do the others'
        self.log.ops.append(BlocksToHost(self._hosts.new(host), list(block_ids)))
        return host

    def _from_host(self, host: torch.Tensor, host_blocks: list[int], block_ids: list[int]) -> None:
        super()._from_host(host, host_blocks, block_ids)
        self.log.ops.append(BlocksFromHost(self._hosts[host], list(host_blocks), list(block_ids)))


class RecordingContiguousKVCache(ContiguousKVCache):
    """ContiguousKVCache whose fork copies and swaps are logged for the other ranks.

    A swapped-out sequence's host copy is keyed by its seq_id: it has one until swapped in or freed.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.log = OpLog()

    def prepare(self, batch: StepBatch) -> DenseSlotPlan:
        plan = super().prepare(batch)
        self.log.prepared(batch, SlotStep([self.seqs[s.seq_id].slot for s in batch.steps]))
        return plan

    def fork(self, parent_id: int, child_id: int) -> None:
        super().fork(parent_id, child_id)
        parent = self.seqs[parent_id]
        self.log.ops.append(CopySlot(parent.slot, self.seqs[child_id].slot, parent.length))

    def swap_out(self, seq_ids: Sequence[int]) -> None:
        slots = {i: self._resident(i).slot for i in seq_ids}
        super().swap_out(seq_ids)
        self.log.ops += [SlotToHost(i, slot, self.seqs[i].length) for i, slot in slots.items()]

    def swap_in(self, seq_ids: Sequence[int]) -> None:
        super().swap_in(seq_ids)  # all or nothing
        self.log.ops += [HostToSlot(i, self.seqs[i].slot) for i in seq_ids]

    def free(self, seq_id: int) -> None:
        swapped = self._get(seq_id).slot < 0
        super().free(seq_id)
        if swapped:
            self.log.ops.append(DropHost(seq_id))
