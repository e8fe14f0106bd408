"""Physical pages handed out in page sets: one page per column of every K/V tensor.

A slot always grows in every tensor at once, so the cache allocates, shares and frees
whole sets. Unit u of set j is physical page pages[u * num_sets + j]: a slot holding
consecutive set ids holds physically consecutive pages in each column, which the driver
maps in one call and the host kernel keeps as one mapping (VMA). vm.max_map_count
(65,530) would otherwise cap how many pages can be mapped at all.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np


class PageSetPool:
    """Free page sets as a bitmap, so allocation can continue a slot's physical run."""

    def __init__(self, pages: Sequence[int], units: int, run: int = 1) -> None:
        """run: a slot with no pages starts on a multiple of this many sets, so that where
        set ids are pool pages (one unit) its runs line up with the driver's huge pages."""
        self.units = units
        self.run = run
        self.num_sets = len(pages) // units
        if self.num_sets < 1:
            raise ValueError(f"{len(pages)} pages make no page set of {units} pages")
        self._pages = sorted(pages)[: self.num_sets * units]
        self._free = np.ones(self.num_sets, dtype=bool)
        self._free_count = self.num_sets
        self.refcount = [0] * self.num_sets
        # the prefix index's holdings, and how many of its sets it alone holds: what evicting every
        # evictable chunk frees, kept as a count because a scan of the index under the cache lock
        # took a third of the mapper thread's samples once thousands of chunks were cached
        self._indexed = [False] * self.num_sets
        self.index_only = 0
        # bumped whenever a set becomes or stops being shared (held twice or more): what decides
        # whether an idle slot's kept pages may be rewritten (SlotTable.usable)
        self.sharing = 0
        self.peak_held = 0  # most sets held at once
        self._resident = np.zeros(self.num_sets, dtype=bool)  # taken since its memory last went back
        self._freed_at = np.zeros(self.num_sets)  # monotonic seconds it last became free

    @property
    def free_count(self) -> int:
        return self._free_count

    def is_free(self, set_id: int) -> bool:
        return bool(self._free[set_id % self.num_sets])

    def physical(self, set_id: int, unit: int) -> int:
        return self._pages[unit * self.num_sets + set_id]

    def take(self, n: int, prefer: int | None) -> list[int]:
        """n free sets, each the first free one at or after its predecessor (wrapping).

        prefer: where the first should go (the set after a slot's last one); None for a
        slot with no pages, which starts in the middle of the largest free run so that
        the runs of growing slots spread out instead of colliding.
        """
        if n > self._free_count:
            raise ValueError(f"{n} page sets requested, {self._free_count} free")
        out = []
        want = self._start_of_new_run() if prefer is None else prefer % self.num_sets
        for _ in range(n):
            if not self._free[want]:
                after = self._free[want:]
                i = int(after.argmax())
                want = want + i if after[i] else int(self._free.argmax())
            self._free[want] = False
            self._resident[want] = True
            self.refcount[want] = 1
            out.append(want)
            want = (want + 1) % self.num_sets
        self._free_count -= n
        self.peak_held = max(self.peak_held, self.num_sets - self._free_count)
        return out

    def _start_of_new_run(self) -> int:
        """The middle of the largest free run, rounded down to a multiple of self.run inside it
        (up if that leaves it; the middle itself if neither is inside); a run at the very
        start begins at 0."""
        edges = np.diff(np.concatenate(([0], self._free.view(np.int8), [0])))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        if not len(starts):
            return 0
        i = int((ends - starts).argmax())
        start, end = int(starts[i]), int(ends[i])
        if not start:
            return 0
        middle = (start + end) // 2
        want = middle - middle % self.run
        if want < start:
            want += self.run
        return want if want < end else middle

    def resident_free(self, freed_before: float | None) -> list[int]:
        """Free sets whose memory the OS may still back (used since it last went back), free
        since before freed_before (None: any)."""
        idle = self._free & self._resident
        if freed_before is not None:
            idle &= self._freed_at <= freed_before
        return np.flatnonzero(idle).tolist()

    def backdate(self, set_ids: list[int]) -> None:
        """Count these sets as free since long ago (they were idle while kept)."""
        self._freed_at[set_ids] = 0.0

    def returned(self, set_ids: list[int]) -> None:
        """These free sets' memory went back to the OS."""
        self._resident[set_ids] = False

    def share(self, set_id: int, index: bool = False) -> None:
        """One more holder of this set: a slot mapping it (fork, prefix hit) or, with index, the
        prefix index (which holds a set at most once)."""
        sole = self._index_only(set_id)
        self.refcount[set_id] += 1
        self._indexed[set_id] |= index
        self.index_only += self._index_only(set_id) - sole
        self.sharing += 1  # a held set gains a holder: shared now

    def release(self, set_id: int, index: bool = False) -> None:
        """One holder (with index: the prefix index) let go of this set; the last one returns it
        to the free list."""
        sole = self._index_only(set_id)
        self.sharing += self.refcount[set_id] > 1  # it was shared
        self.refcount[set_id] -= 1
        if index:
            self._indexed[set_id] = False
        self.index_only += self._index_only(set_id) - sole
        if self.refcount[set_id] == 0:
            self._freed_at[set_id] = time.monotonic()
            self._free[set_id] = True
            self._free_count += 1

    def _index_only(self, set_id: int) -> bool:
        return self._indexed[set_id] and self.refcount[set_id] == 1
