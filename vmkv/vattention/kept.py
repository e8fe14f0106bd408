"""Pages kept for reuse, and when they go back (issue 15's idle memory).

Deferred reclamation (idle slots keep their pages mapped) and prefix caching (chunks nobody
maps stay indexed) both keep memory that no sequence uses. One policy bounds both: up to a
watermark of the page sets may stay kept; beyond it, kept sets idle longer than the idle time
are unmapped (least recently used first) and, with every other free set that was used, their
memory goes back to the OS. Under memory pressure from the machine's other tenants the idle
time does not wait. Under pressure from this cache's own allocations nothing changes: kept
sets are reclaimed at once, as before (slots.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from vmkv.drivers import memory_info
from vmkv.vattention.slots import Slot, SlotTable


def trim(table: SlotTable, force: bool, drop_reserve: bool = False) -> int:
    """Unmap kept sets beyond the watermark that were idle for kept_idle_seconds (any, with
    force), with drop_reserve the pre-mapped reserve first (SlotTable.reserve: the cache went
    quiet), then give the memory of used sets free that long back to the OS; returns the sets
    unmapped. Sets just freed keep their memory: a busy cache takes them again soon."""
    cfg = table.config
    if not force and cfg.kept_idle_seconds is None:
        return 0
    idle_before = None if force else time.monotonic() - cfg.kept_idle_seconds
    trimmed = _drop_reserve(table) if drop_reserve else []
    trimmed += _unmap_kept(table, int(cfg.kept_watermark * table.pool.num_sets), idle_before)
    table.pool.backdate(trimmed)  # idle long while kept: their memory goes now too
    table.mapping.return_memory(idle_before)
    return len(trimmed)


def _drop_reserve(table: SlotTable) -> list[int]:
    """Unmap every private idle slot's pages; returns the sets."""
    dropped: list[int] = []
    for slot in table.private_idle():
        dropped += slot.sets
        table.mapping.drop_pages(slot, 0)
    table.mapping.events.page_sets_trimmed += len(dropped)
    return dropped


def _unmap_kept(table: SlotTable, watermark_sets: int, idle_before: float | None) -> list[int]:
    """Unmap kept sets beyond watermark_sets, idle since idle_before (None: any): idle slots'
    longest idle first, then cached chunks least recently used first; returns the sets."""
    trimmed: list[int] = []
    idle = sorted((s for s in table.idle() if s.sets), key=lambda s: s.idle_since)
    for slot in idle:
        excess = table.kept() - watermark_sets
        if excess <= 0 or (idle_before is not None and slot.idle_since > idle_before):
            break
        keep = _keep_for(table, slot, excess)
        gone = slot.sets[keep:]
        table.mapping.drop_pages(slot, keep)
        trimmed += [s for s in gone if table.pool.refcount[s] == 0]  # cached ones stay, evictable
    excess = table.kept() - watermark_sets
    if excess > 0 and table.prefix is not None:
        trimmed += table.prefix.evict(excess, idle_before)
    table.mapping.events.page_sets_trimmed += len(trimmed)
    return trimmed


def _keep_for(table: SlotTable, slot: Slot, excess: int) -> int:
    """How many of the idle slot's leading pages to keep so that dropping the rest frees up to
    `excess` kept sets. Only sets this slot alone holds count: a set another slot or the prefix
    index also holds stays held when this slot lets it go (a fork's page in a running
    sequence's slot is in use, not kept)."""
    keep, freed = len(slot.sets), 0
    while keep > 0 and freed < excess:
        keep -= 1
        freed += table.pool.refcount[slot.sets[keep]] == 1
    return keep


def memory_pressure(min_available: float) -> bool:
    """Whether the machine's available memory is below min_available of its total (Linux)."""
    info = memory_info() if min_available > 0 else None
    return info is not None and info[0] < min_available * info[1]


class Trimmer:
    """A daemon thread calling `work` every `interval` seconds until closed."""

    def __init__(self, work: Callable[[], None], interval: float) -> None:
        self._work, self._interval = work, interval
        self._stop = threading.Event()
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name="vattention-trimmer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._work()
            except Exception as e:  # trimming is housekeeping; the next round tries again
                self.errors.append(e)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
