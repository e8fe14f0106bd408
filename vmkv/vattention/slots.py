"""The slot table and its placement policy: which slot a sequence gets, which page sets back it,
and which kept pages are reclaimed when free ones run short.

Deferred reclamation: a freed slot keeps its pages for the next sequence placed there, and
a sequence may hold pages mapped ahead of its needs; both are reclaimed (idle slots first)
before memory is reported short. The caller holds the cache's lock around every call.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field
from itertools import chain

import torch

from vmkv.kv_cache import OutOfKVMemory
from vmkv.prefix_cache import BlockKey, CacheIdentity
from vmkv.vattention.config import VAttentionConfig
from vmkv.vattention.mapping import Slot, SlotMapping
from vmkv.vattention.prefix import PrefixIndex

RECLAIM_BATCH = 1 / 64  # of the page sets: kept pages freed beyond a reclaim's need (_reclaim)


@dataclass
class SlotSeq:
    """A sequence in the cache: its slot and how many of its tokens are reserved and written."""

    slot: int  # -1 while swapped out
    length: int  # tokens reserved: prompt + every grow
    written: int = 0  # tokens some finished step has written; fork shares only pages below this
    host_kv: torch.Tensor | None = None  # [tensors, length, Hkv, D] while swapped out
    # prefix caching only: the tokens, their chunk hashes, and the keys of its written chunks
    token_ids: list[int] = field(default_factory=list)
    identity: CacheIdentity = ("", None)
    hashes: list[int] = field(default_factory=list)
    keys: list[BlockKey] = field(default_factory=list)


class SlotTable:
    def __init__(self, mapping: SlotMapping, config: VAttentionConfig, prefix: PrefixIndex | None) -> None:
        self.mapping, self.config, self.prefix = mapping, config, prefix
        self.geometry, self.pool = mapping.geometry, mapping.pool
        self.slots = [Slot(i) for i in range(self.geometry.max_slots)]
        self.seqs: dict[int, SlotSeq] = {}

    def idle(self) -> list[Slot]:
        return [s for s in self.slots if s.seq_id is None]

    def pick(self, needed: int, among: list[Slot] | None = None) -> Slot | None:
        """An idle slot (of `among`, when given): the one with the fewest usable kept pages that
        are enough (the best fit, so a slot backed for a longer upcoming prompt stays for it),
        else the one keeping the most."""
        idle = self.idle() if among is None else among
        if not idle:
            return None
        enough = [s for s in idle if self.usable(s) >= needed]
        if enough:
            return min(enough, key=lambda s: (self.usable(s), s.index))
        return min(idle, key=lambda s: (-self.usable(s), s.index))

    def usable(self, slot: Slot) -> int:
        """Kept pages a new sequence may write: all of an idle slot's, unless it keeps a set someone
        else holds (a cached chunk, a fork's page); then none, and clear_shared drops them all
        before the slot stores anything.

        Kept from the last call while the slot holds as many sets and no set became or stopped
        being shared: sets come and go privately otherwise. (The mapper's every job samples the
        reserve, and rescanning ~8,000 kept sets each time cost ~0.2 ms of CPU a job.)"""
        key = (self.pool.sharing, len(slot.sets))
        if slot.usable[0] != key:
            shared = any(self.pool.refcount[s] > 1 for s in slot.sets)
            slot.usable = (key, 0 if shared else len(slot.sets))
        return slot.usable[1]

    def reusing(self, slots: list[Slot]) -> list[Slot]:
        """Of idle slots about to hold sequences, those whose kept pages are reused (the rest are
        dropped whole, so their pages count as available)."""
        return [s for s in slots if self.usable(s)]

    def clear_shared(self, slot: Slot) -> None:
        """Drop an idle slot's kept pages if they start with a shared set (see usable)."""
        if slot.sets and not self.usable(slot):
            self.mapping.drop_pages(slot, 0)

    def place(self, seq_id: int, seq: SlotSeq, eager: bool) -> None:
        """Place a sequence none of whose prompt is cached: an idle slot, its kept pages reused."""
        needed = self.geometry.pages_for(seq.length)
        slot = self.pick(needed)
        if slot is None:
            raise OutOfKVMemory(1, 0, "slots")
        self.require(needed - self.usable(slot), exclude=self.reusing([slot]))
        self.clear_shared(slot)
        reused = min(needed, len(slot.sets))
        self.back(slot, needed, seq.length, eager)  # a failed map leaves it idle
        self.mapping.events.page_sets_reused += reused
        self.assign(slot, seq_id)
        seq.slot = slot.index

    def assign(self, slot: Slot, seq_id: int) -> None:
        """The slot now belongs to seq_id; the generation bump drops stale mapper jobs."""
        slot.seq_id = seq_id
        slot.generation += 1

    def release(self, slot: Slot, keep_pages: bool = False) -> None:
        """The slot becomes idle; stale mapper jobs for it are dropped by the generation bump."""
        slot.seq_id = None
        slot.generation += 1
        slot.pinned = 0
        slot.idle_since = time.monotonic()
        if not keep_pages:
            self.mapping.drop_pages(slot, 0)

    def fork(self, parent: SlotSeq, child_id: int) -> None:
        """Place child_id in an idle slot (the one keeping the fewest pages: they are dropped),
        sharing the parent's full written pages and copying the rest."""
        geo, mapping = self.geometry, self.mapping
        idle = self.idle()
        if not idle:
            raise OutOfKVMemory(1, 0, "slots")
        slot = min(idle, key=lambda s: (len(s.sets), s.index))
        src = self.slots[parent.slot]
        shared = src.sets[: parent.written * geo.column_token_bytes // geo.page_size]
        copied = geo.pages_for(parent.length) - len(shared)
        self.require(copied, exclude=[])  # the chosen slot's kept pages count: they are dropped
        mapping.drop_pages(slot, 0)
        self.assign(slot, child_id)
        self.seqs[child_id] = SlotSeq(
            slot.index,
            parent.length,
            parent.written,
            token_ids=list(parent.token_ids),
            identity=parent.identity,
            hashes=list(parent.hashes),
            keys=list(parent.keys),
        )
        try:
            if shared:
                for set_id in shared:
                    self.pool.share(set_id)
                mapping.map_sets(slot, shared, background=False)
            if copied:
                mapping.map_sets(slot, self.take(copied, slot), background=False)
        except BaseException:
            self.release(slot)
            del self.seqs[child_id]
            raise
        mapping.copy_pages(src.index, slot.index, len(shared), copied)
        mapping.events.fork_shared_pages += len(shared) * geo.units
        mapping.events.fork_copied_pages += copied * geo.units

    def map_cached(self, slot: Slot, sets: list[int]) -> None:
        """Map cached page sets at an empty slot's first pages (a prefix hit): one holder more each.
        A failed map gives the references back (map_sets releases what it was given)."""
        if not sets:
            return
        for set_id in sets:
            self.pool.share(set_id)
        self.mapping.map_sets(slot, sets, background=False)

    def copy_on_write(self, slot: Slot, first: int) -> None:
        """Before a write lands in the slot's shared pages from `first` on, give it private
        copies: the bytes are saved, the shared sets unmapped (one holder less each), fresh sets
        mapped at the same pages and the bytes written back. Nobody else sees any change. The
        caller checked that the fresh sets can be found (require)."""
        count = len(slot.sets) - first
        saved = self.mapping.read_pages(slot.index, first, count)
        self.mapping.drop_pages(slot, first)
        self.mapping.map_sets(slot, self.take(count, slot), background=False)
        self.mapping.write_pages(slot.index, first, saved)
        self.mapping.events.cow_copies += count * self.geometry.units

    def mappers(self, running_only: bool = False) -> dict[int, int]:
        """How many slots (or sequences' slots) map each page set that some slot maps."""
        # Counter counts in C: stats() runs this every step over every mapped set (~7,000 at
        # batch 64 x 300 tokens, where the Python loop it replaced took ~1 ms a call)
        return Counter(
            chain.from_iterable(s.sets for s in self.slots if not running_only or s.seq_id is not None)
        )

    def pin(self, seqs: list[SlotSeq]) -> None:
        """The step's plan reads these sequences' pages: none of them is reclaimed under it."""
        for slot in self.slots:
            slot.pinned = 0
        for seq in seqs:
            self.slots[seq.slot].pinned = len(self.slots[seq.slot].sets)

    def back(self, slot: Slot, needed: int, length: int, eager: bool) -> None:
        """Map the pages tokens 0..length-1 need (critical path), plus eager ones if free."""
        if needed > len(slot.sets):
            self.mapping.map_sets(slot, self.take(needed - len(slot.sets), slot), background=False)
        if self.config.eager_steps and eager:
            want = self.geometry.pages_for(length + self.config.eager_steps) - len(slot.sets)
            if 0 < want <= self.pool.free_count:
                with contextlib.suppress(OutOfKVMemory):  # eager pages are best effort
                    self.mapping.map_sets(slot, self.pool.take(want, self.prefer(slot)), background=False)

    def take(self, n: int, slot: Slot) -> list[int]:
        """n page sets for `slot` to map now. The pre-mapped reserve gives up as many (so a
        sequence that maps converts the reserve instead of adding to the held total), and
        they are taken unless the slot's run goes on free: an unbroken run of a layer-packed
        slot becomes huge pages (geometry.run_pages), which the decode reads faster than
        populated memory saves at its first map. Kept pages are reclaimed when short (checked
        by require)."""
        spare = self._release_reserve(n, exclude=slot)
        if n > self.pool.free_count:
            self._reclaim(n - self.pool.free_count, exclude=slot)
        after = self.prefer(slot)
        if spare and (after is None or not self.pool.is_free(after)):
            after = spare[0]
        return self.pool.take(n, after)

    def _release_reserve(self, n: int, exclude: Slot) -> list[int]:
        """Unmap up to n sets from the tails of private idle slots (the reserve), highest slot
        first (SlotTable.pick prefers the lowest); returns them, now free."""
        freed: list[int] = []
        for slot in sorted(self.private_idle(), key=lambda s: -s.index):
            if len(freed) >= n:
                break
            if slot is not exclude:
                keep = len(slot.sets) - min(n - len(freed), len(slot.sets))
                freed += slot.sets[keep:]
                self.mapping.drop_pages(slot, keep)
        self.mapping.events.page_sets_reclaimed += len(freed)
        return freed

    @staticmethod
    def prefer(slot: Slot) -> int | None:
        """Continue the slot's physical run; a fresh slot lets the pool place it."""
        return slot.sets[-1] + 1 if slot.sets else None

    def reclaimable(self, slot: Slot) -> int:
        """A running slot's pages that can go without touching anything its sequence needs or
        a plan reads (mapped ahead, group padding). Idle slots' pages count in kept()."""
        if slot.seq_id is None:
            return 0
        seq = self.seqs[slot.seq_id]
        return max(0, len(slot.sets) - max(self.geometry.pages_for(seq.length), slot.pinned))

    def in_use(self, exclude: Slot | list[Slot] | None = None) -> set[int]:
        """Page sets some sequence's slot maps, or a slot in `exclude` (its caller reuses them)."""
        skip = _indices(exclude)
        used: set[int] = set()
        for slot in self.slots:
            if slot.seq_id is not None or slot.index in skip:
                used.update(slot.sets)
        return used

    def available(self, exclude: Slot | list[Slot] | None = None) -> int:
        """Free page sets, kept ones (all held sets no sequence or `exclude` maps) and running
        sequences' reclaimable surplus outside `exclude`."""
        skip = _indices(exclude)
        kept = self.pool.num_sets - self.pool.free_count - len(self.in_use(exclude))
        return (
            self.pool.free_count + kept + sum(self.reclaimable(s) for s in self.slots if s.index not in skip)
        )

    def kept(self) -> int:
        """Page sets held only for reuse: mapped by idle slots only (deferred reclamation) or
        cached chunks nobody maps. All of them can go back at once."""
        return self.pool.num_sets - self.pool.free_count - len(self.in_use())

    def private_idle(self) -> list[Slot]:
        """Idle slots whose kept pages a new sequence may write (none shared): the reserve."""
        return [s for s in self.idle() if s.sets and self.usable(s)]

    def reserve(self, exclude: Slot | list[Slot] | None = None) -> int:
        """Page sets mapped into private idle slots (outside `exclude`) for the next admissions
        (pre-mapped, or a finished sequence's pages kept by deferred reclamation): held, but
        backing no sequence, and each can be freed at once."""
        skip = _indices(exclude)
        return sum(self.usable(s) for s in self.slots if s.seq_id is None and s.sets and s.index not in skip)

    def require(self, missing: int, exclude: Slot | list[Slot]) -> None:
        """Raise OutOfKVMemory, before any change, unless `missing` page sets can be found."""
        if missing <= self.pool.free_count or missing <= self.pool.free_count + self.reserve(exclude):
            return  # found without walking every mapped set
        available = self.available(exclude)
        if missing > available:
            units = self.geometry.units
            raise OutOfKVMemory(missing * units, available * units, "pages")

    def _reclaim(self, n: int, exclude: Slot) -> None:
        """Free n page sets (require checked they exist): idle slots' kept pages first (highest
        slot first, each whole: what it shares may sit anywhere in it), then cached chunks
        least recently used first, then running sequences' mapped-ahead pages.

        Kept pages go RECLAIM_BATCH of the pool at a time: a full cache otherwise reclaims one
        set per growing sequence per step, each time walking the slots and the index (64
        sequences growing in a full 1 GiB cache: ~0.8 s of the step thread's time per 128
        tokens, against ~0.1 s for paged's block pool)."""
        goal = self.pool.free_count + n
        batch = goal + int(RECLAIM_BATCH * self.pool.num_sets)
        for slot in sorted(self.idle(), key=lambda s: -s.index):
            if self.pool.free_count >= batch:
                return
            if slot is not exclude and slot.sets:
                self.mapping.events.page_sets_reclaimed += len(slot.sets)
                self.mapping.drop_pages(slot, 0)
        if self.pool.free_count < batch and self.prefix is not None:
            self.prefix.evict(batch - self.pool.free_count)
        for slot in sorted((s for s in self.slots if s.seq_id is not None), key=lambda s: -s.index):
            take = min(goal - self.pool.free_count, self.reclaimable(slot)) if slot is not exclude else 0
            if take > 0:
                self.mapping.drop_pages(slot, len(slot.sets) - take)
                self.mapping.events.page_sets_reclaimed += take


def _indices(exclude: Slot | list[Slot] | None) -> set[int]:
    """The indices of the slots a caller excludes: one slot, a list of them, or none."""
    slots = exclude if isinstance(exclude, list) else [exclude]
    return {s.index for s in slots if s is not None}
