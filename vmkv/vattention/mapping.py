"""The slots' virtual memory: reservations, zero-copy K/V views, and page mapping with rollback.

Per layer, K and V are views [max_slots, max_len, Hkv, D] over virtual regions (one per K/V
tensor, or one holding every layer's K and V in the packed order; see geometry.py), each
reserved through the driver (or all in one reservation). A slot's pages are mapped page set
by page set, in every column of every region at once, so
one list of set ids per slot describes its whole mapping. This file is the mechanism only:
which slot gets which sets is the slot table's policy (slots.py).

Every change to what backs a slot's pages (map, unmap) or to what they hold outside a step's
attention (fork copies, copy-on-write, swap) is made here, by slot index, and told to an
optional observer in order: tensor parallelism's rank 0 logs them, and every other rank
replays them on its own mapping at the same offsets (vmkv/distributed/).
"""

from __future__ import annotations

import errno
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from vmkv.drivers import MemoryDriver, RawCallError, Reservation
from vmkv.kv_cache import OutOfKVMemory
from vmkv.vattention.geometry import SlotGeometry
from vmkv.vattention.pool import PageSetPool


@dataclass
class Slot:
    """One sequence's region in every K/V tensor, and the page sets mapped into it."""

    index: int
    sets: list[int] = field(default_factory=list)  # page-set id mapped at each page index
    seq_id: int | None = None  # None: idle (it may still keep pages)
    generation: int = 0  # bumped whenever the owner changes; stale mapper jobs compare it
    pinned: int = 0  # pages the current step's plan reads; never reclaimed under it
    idle_since: float = 0.0  # monotonic seconds when it last fell idle or was pre-mapped (trimming's clock)
    usable: tuple[tuple[int, int], int] = ((-1, 0), 0)  # SlotTable.usable's last answer, and its key


@dataclass
class MappingEvents:
    """The cache's own event counts (KVStats fields of the same names)."""

    map_calls_critical: int = 0
    map_calls_background: int = 0
    map_seconds_critical: float = 0.0
    map_seconds_background: float = 0.0
    unmap_calls: int = 0
    group_pad_page_sets: int = 0
    page_sets_reused: int = 0
    page_sets_reclaimed: int = 0
    ahead_skipped: int = 0
    minor_faults: int = 0
    fork_shared_pages: int = 0
    fork_copied_pages: int = 0
    cow_copies: int = 0  # pages given a private copy before a write (a whole-prompt prefix hit)
    page_sets_trimmed: int = 0  # kept sets unmapped by the idle policy (kept.py)
    pages_returned: int = 0  # pages whose memory went back to the OS (idle trimming)
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0


class MappingObserver(Protocol):
    """Told of each change a SlotMapping makes, after it is made, in order (under the cache's lock).

    Host copies are the tensors the read methods return; they are passed back to the write methods.
    """

    def mapped(self, slot: int, first: int, sets: list[int]) -> None: ...
    def unmapped(self, slot: int, first: int, count: int) -> None: ...
    def copied(self, src: int, dst: int, first: int, count: int) -> None: ...
    def pages_read(self, host: torch.Tensor, slot: int, first: int, count: int) -> None: ...
    def pages_written(self, host: torch.Tensor, slot: int, first: int) -> None: ...
    def tokens_read(self, host: torch.Tensor, slot: int, length: int) -> None: ...
    def tokens_written(self, host: torch.Tensor, slot: int) -> None: ...


class SlotMapping:
    """Owns the driver pages of num_sets page sets and the reservations of every region."""

    def __init__(
        self,
        driver: MemoryDriver,
        owns_driver: bool,
        geometry: SlotGeometry,
        dtype: torch.dtype,
        num_sets: int,
        combined_reservation: bool,
    ) -> None:
        self.driver, self.geometry = driver, geometry
        self.events = MappingEvents()
        self.observer: MappingObserver | None = None
        self._owns_driver = owns_driver
        self.placed: list[tuple[Reservation, int]] = []
        self._pages: list[int] = []
        try:
            self._pages = driver.alloc(num_sets * geometry.units)
            self.pool = PageSetPool(self._pages, geometry.units, geometry.run_pages)
            self._reserve(dtype, combined_reservation)
        except BaseException:
            self.give_back()
            raise

    def _reserve(self, dtype: torch.dtype, combined: bool) -> None:
        """One reservation per region (or one for all), and the K/V views over them."""
        geo, drv = self.geometry, self.driver
        if combined:
            whole = drv.reserve(geo.regions * geo.region_bytes)
            self.placed = [(whole, r * geo.region_bytes) for r in range(geo.regions)]
        else:
            for _ in range(geo.regions):
                self.placed.append((drv.reserve(geo.region_bytes), 0))
        numel = geo.region_bytes // geo.itemsize
        self._bytes = [
            drv.view(r, torch.uint8, [geo.region_bytes], off, require_mapped=False) for r, off in self.placed
        ]
        views = geo.views([drv.view(r, dtype, [numel], off, require_mapped=False) for r, off in self.placed])
        self.k, self.v = views[0::2], views[1::2]  # per layer

    def tensors(self) -> list[torch.Tensor]:
        """Every K/V view in reservation order (K0, V0, K1, V1, ...)."""
        return [view for pair in zip(self.k, self.v, strict=True) for view in pair]

    def map_sets(self, slot: Slot, sets: list[int], background: bool) -> None:
        """Map page sets at the slot's next page indices, in every column of every region.

        All or nothing: a failed driver call unmaps what this call mapped and gives the sets
        back; ENOMEM (vm.max_map_count, or the machine out of memory) becomes OutOfKVMemory.
        """
        calls = self.driver.stats.map_calls
        t0 = time.perf_counter()
        try:
            self.map_at(slot.index, len(slot.sets), sets)
        except RawCallError as e:
            for set_id in sets:
                self.pool.release(set_id)
            if e.errno == errno.ENOMEM:
                raise OutOfKVMemory(len(sets) * self.geometry.units, 0, "pages") from e
            raise
        finally:
            calls, seconds = self.driver.stats.map_calls - calls, time.perf_counter() - t0
            if background:
                self.events.map_calls_background += calls
                self.events.map_seconds_background += seconds
            else:
                self.events.map_calls_critical += calls
                self.events.map_seconds_critical += seconds
        slot.sets.extend(sets)

    def map_at(self, slot: int, first: int, sets: list[int]) -> None:
        """Map page sets at pages first.. of slot `slot`; a failed call unmaps what this one mapped."""
        geo = self.geometry
        started: list[tuple[Reservation, int]] = []
        try:
            for t, (res, base) in enumerate(self.placed):
                for c in range(geo.columns):
                    offset = base + geo.page_offset(slot, c, first)
                    started.append((res, offset))
                    self.driver.map(res, offset, [self.pool.physical(s, t * geo.columns + c) for s in sets])
        except RawCallError:
            for res, offset in started:
                for i in range(len(sets)):
                    if self.driver.is_mapped(res, offset + i * geo.page_size, geo.page_size):
                        self.driver.unmap(res, offset + i * geo.page_size)
            raise
        if self.observer is not None:
            self.observer.mapped(slot, first, list(sets))

    def drop_pages(self, slot: Slot, keep: int) -> None:
        """Unmap the slot's pages from index keep on and release their sets."""
        if len(slot.sets) <= keep:
            return
        self.unmap_at(slot.index, keep, len(slot.sets) - keep)
        for set_id in slot.sets[keep:]:
            self.pool.release(set_id)
        del slot.sets[keep:]

    def unmap_at(self, slot: int, first: int, count: int) -> None:
        """Unmap pages first..first+count-1 of slot `slot` in every column of every region."""
        geo = self.geometry
        for res, base in self.placed:
            for c in range(geo.columns):
                self.driver.unmap(res, base + geo.page_offset(slot, c, first), count)
                self.events.unmap_calls += 1
        if self.observer is not None:
            self.observer.unmapped(slot, first, count)

    def copy_pages(self, src: int, dst: int, first: int, count: int) -> None:
        """Copy pages first..first+count-1 of every column of every region from slot src to dst."""
        geo = self.geometry
        start, nbytes = first * geo.page_size, count * geo.page_size
        for data in self._bytes:
            for c in range(geo.columns):
                to = geo.page_offset(dst, c, 0) + start
                from_ = geo.page_offset(src, c, 0) + start
                data[to : to + nbytes].copy_(data[from_ : from_ + nbytes])
        if self.observer is not None:
            self.observer.copied(src, dst, first, count)

    def read_pages(self, slot: int, first: int, count: int) -> torch.Tensor:
        """A host copy of pages first..first+count-1 of every column of every region
        (copy-on-write): one row of bytes per region and column."""
        geo = self.geometry
        nbytes = count * geo.page_size
        out = torch.empty(
            len(self._bytes) * geo.columns, nbytes, dtype=torch.uint8, device=self._bytes[0].device
        )
        rows = iter(out)
        for data in self._bytes:
            for c in range(geo.columns):
                at = geo.page_offset(slot, c, first)
                next(rows).copy_(data[at : at + nbytes])
        if self.observer is not None:
            self.observer.pages_read(out, slot, first, count)
        return out

    def write_pages(self, slot: int, first: int, saved: torch.Tensor) -> None:
        """Write read_pages' copy back at the same pages (now mapped to other sets)."""
        geo = self.geometry
        rows = iter(saved)
        for data in self._bytes:
            for c in range(geo.columns):
                row = next(rows)
                at = geo.page_offset(slot, c, first)
                data[at : at + row.numel()].copy_(row)
        if self.observer is not None:
            self.observer.pages_written(saved, slot, first)

    def read_tokens(self, slot: int, length: int) -> torch.Tensor:
        """A host copy of the slot's first `length` tokens in every K/V view (swap-out):
        [tensors, length, Hkv, D]."""
        host = torch.stack([view[slot, :length].to("cpu", copy=True) for view in self.tensors()])
        if self.observer is not None:
            self.observer.tokens_read(host, slot, length)
        return host

    def write_tokens(self, slot: int, host: torch.Tensor) -> None:
        """Write read_tokens' copy into slot `slot`'s first tokens (swap-in; the pages are mapped)."""
        for t, view in enumerate(self.tensors()):
            view[slot, : host.shape[1]] = host[t].to(view.device)
        if self.observer is not None:
            self.observer.tokens_written(host, slot)

    def return_memory(self, freed_before: float | None) -> None:
        """Give the memory of free sets that were used, free since freed_before (None: any),
        back to the OS.

        Only over a driver this cache built: punching frees pages to the driver's pool and
        takes the same ones back at once, which is safe only when nobody else allocates there.
        """
        sets = self.pool.resident_free(freed_before)
        if not self._owns_driver or self.driver.preallocated or not sets:
            return
        pages = [self.pool.physical(s, u) for s in sets for u in range(self.geometry.units)]
        self.driver.free(pages, punch=True)
        again = self.driver.alloc(len(pages))
        if sorted(again) != sorted(pages):  # nobody else allocates from a driver the cache built
            raise RuntimeError("the driver handed back other pages after a punch")
        self.pool.returned(sets)
        self.events.pages_returned += len(pages)

    def assert_backed(self, slot: Slot, num_tokens: int) -> None:
        """Raise unless every byte of the slot's first num_tokens is mapped (config.debug)."""
        geo = self.geometry
        for res, base in self.placed:
            for c in range(geo.columns):
                self.driver.assert_mapped(
                    res, base + geo.page_offset(slot.index, c, 0), num_tokens * geo.column_token_bytes
                )

    def give_back(self) -> None:
        """Unreserve and free the pages (or close a driver this cache built)."""
        if self.driver.closed:
            return
        if self._owns_driver:
            self.driver.close()
            return
        for res in {r for r, _ in self.placed}:
            self.driver.release(res)
        self.driver.free(self._pages)
