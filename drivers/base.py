"""The physical-memory driver contract shared by the host (memfd) and CUDA drivers.

A driver hands out virtual address ranges (reservations) and owns a bounded pool of
physical pages, all of one page size. Callers allocate pool pages, map them at
page-aligned offsets of a reservation, unmap them, and read a reservation through a
zero-copy torch view. The bookkeeping that makes wrong use a Python exception rather
than a crash lives here, once; subclasses only issue the raw OS / driver calls.

Every public method validates all of its arguments before the first raw call, so a
wrong call raises and changes nothing. If a raw call itself fails part way, the
bookkeeping records exactly what went through.
"""

from __future__ import annotations

import operator
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from vmkv import faults

from .errors import (
    AlreadyMappedError,
    DriverClosedError,
    InvalidOffsetError,
    NotMappedError,
    PageStateError,
    PoolExhaustedError,
)


@dataclass(eq=False)
class Reservation:
    """A reserved virtual range. `mapped` maps page index within the range -> pool page."""

    base: int
    size: int
    mapped: dict[int, int] = field(default_factory=dict)
    released: bool = False

    @property
    def end(self) -> int:
        return self.base + self.size


@dataclass
class DriverStats:
    """What the driver did; benchmarks report these as the layout's page faults."""

    map_calls: int = 0
    unmap_calls: int = 0
    pages_mapped: int = 0
    peak_pages_mapped: int = 0
    map_seconds: float = 0.0
    unmap_seconds: float = 0.0
    exhaustion_events: int = 0
    pages_punched: int = 0

    def snapshot(self) -> DriverStats:
        return DriverStats(**vars(self))


def runs(items: Sequence[int]) -> list[tuple[int, int]]:
    """Split consecutive integers into (start_index, length) runs."""
    out: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(items) + 1):
        if i == len(items) or items[i] != items[i - 1] + 1:
            out.append((start, i - start))
            start = i
    return out


def as_int(value: object, what: str) -> int:
    """Accept any integer type (int, numpy and 0-d torch integers) as a Python int; refuse bool and float."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {type(value).__name__} {value!r}") from None


class MemoryDriver(ABC):
    """Reserve / allocate / map / unmap / view, with exact counters and precise errors.

    Thread safety: every public method takes one lock, so a background mapping thread
    and the step thread can share a driver.
    """

    device: torch.device
    # bytes of consecutive pool pages, starting at a multiple of this, that the driver backs with
    # one huge page when they are mapped in order at an address aligned the same way (0: none)
    huge_run: int = 0
    # the whole pool is backed from the start (HostDriver(preallocate=True)), so punching pages
    # back to the OS would only undo what was asked for
    preallocated: bool = False

    def __init__(self, page_size: int, num_pages: int, debug: bool = False) -> None:
        page_size = as_int(page_size, "page_size")
        num_pages = as_int(num_pages, "num_pages")
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if num_pages * page_size > sys.maxsize:
            raise ValueError(f"a pool of {num_pages} pages of {page_size} bytes exceeds the address space")
        self.page_size = page_size
        self.num_pages = num_pages
        self.debug = debug
        self._stats = DriverStats()
        self._lock = threading.RLock()
        self._free_pages = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._allocated = [False] * num_pages
        self._map_count = [0] * num_pages  # how many offsets map each pool page (aliasing)
        self._reservations: set[Reservation] = set()
        self._closed = False
        self._faults = faults.active()  # None unless fault injection is on (vmkv/faults.py)

    # ----------------------------------------------------------------- raw hooks
    @abstractmethod
    def _raw_reserve(self, size: int) -> int: ...

    @abstractmethod
    def _raw_release(self, base: int, size: int) -> None: ...

    @abstractmethod
    def _raw_map(self, addr: int, first_page: int, num_pages: int) -> None:
        """Map pool pages first_page .. first_page+num_pages-1 at addr (one run)."""

    @abstractmethod
    def _raw_unmap(self, addr: int, num_pages: int) -> None:
        """Return num_pages mapped pages starting at addr to reserved-only state."""

    @abstractmethod
    def _raw_view(self, addr: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over [addr, addr+nbytes) that does not copy or touch memory (nbytes > 0)."""

    @abstractmethod
    def _raw_close(self) -> None: ...

    def _raw_punch(self, page: int) -> None:  # noqa: B027 - optional: a driver that cannot punch keeps the memory
        """Give a free page's memory back to the OS; drivers that cannot simply keep it."""

    # Drivers whose mappings cannot be split (CUDA) map one page per call.
    merges_runs = True

    @property
    def stats(self) -> DriverStats:
        """A consistent copy of the counters (taken under the lock)."""
        with self._lock:
            return self._stats.snapshot()

    # ------------------------------------------------------------ reservations
    def reserve(self, nbytes: int) -> Reservation:
        """Reserve a virtual range of nbytes rounded up to whole pages; nothing is mapped."""
        nbytes = as_int(nbytes, "reservation size")
        if nbytes <= 0:
            raise ValueError(f"reservation size must be positive, got {nbytes}")
        size = -(-nbytes // self.page_size) * self.page_size
        if size > sys.maxsize:  # the raw calls take a size_t and would silently wrap
            raise ValueError(f"reservation of {nbytes} bytes exceeds the address space")
        with self._lock:
            self._check_open()
            res = Reservation(self._raw_reserve(size), size)
            self._reservations.add(res)
            return res

    def release(self, res: Reservation) -> None:
        """Unmap whatever is still mapped in res and give the virtual range back."""
        with self._lock:
            self._check_reservation(res)
            mapped = sorted(res.mapped)
            for start, length in runs(mapped):
                self._unmap_run(res, mapped[start], length)
            self._raw_release(res.base, res.size)
            res.released = True
            self._reservations.discard(res)

    # ------------------------------------------------------------------- pool
    @property
    def free_page_count(self) -> int:
        return len(self._free_pages)

    def alloc(self, n: int = 1) -> list[int]:
        """Take n pool pages (all or none); raises PoolExhaustedError if fewer are free."""
        n = as_int(n, "page count")
        with self._lock:
            self._check_open()
            if n < 0:
                raise ValueError(f"cannot allocate {n} pages")
            if n > len(self._free_pages):
                self._stats.exhaustion_events += 1
                raise PoolExhaustedError(requested=n, free=len(self._free_pages), total=self.num_pages)
            pages = [self._free_pages.pop() for _ in range(n)]
            for p in pages:
                self._allocated[p] = True
            return pages

    def free(self, pages: Sequence[int], punch: bool = False) -> None:
        """Return unmapped pages to the pool; punch=True also returns their memory to the OS."""
        with self._lock:
            self._check_open()
            pages = [self._check_page(p) for p in pages]
            for p in pages:
                if self._map_count[p]:
                    raise PageStateError(f"page {p} is still mapped at {self._map_count[p]} offset(s)")
            if len(set(pages)) != len(pages):
                raise PageStateError("the same page appears twice in one free()")
            if punch:  # before any page goes back, so a failed punch frees nothing
                for p in pages:
                    self._raw_punch(p)
                    self._stats.pages_punched += 1
            for p in pages:
                self._allocated[p] = False
                self._free_pages.append(p)

    def map_count(self, page: int) -> int:
        """At how many offsets (over all reservations) pool page `page` is mapped now."""
        page = as_int(page, "page")
        with self._lock:
            self._check_pool_index(page)
            return self._map_count[page]

    # ------------------------------------------------------------ map / unmap
    def map(self, res: Reservation, offset: int, pages: Sequence[int]) -> None:
        """Map allocated pool pages at consecutive pages of res starting at offset.

        Physically consecutive pages go down in one call where the driver allows it.
        Validation happens before any call, so an error leaves nothing half-mapped.
        """
        with self._lock:
            self._check_reservation(res)
            pages = [self._check_page(p) for p in pages]
            if not pages:
                raise ValueError("map() needs at least one page")
            first = self._page_index(res, offset, len(pages))
            for i in range(first, first + len(pages)):
                if i in res.mapped:
                    raise AlreadyMappedError(f"offset {i * self.page_size:#x} is already mapped")
            if self._faults is not None:  # after validation: an injected failure maps nothing
                self._faults.on_map()
            step = runs(pages) if self.merges_runs else [(i, 1) for i in range(len(pages))]
            for start, length in step:
                addr = res.base + (first + start) * self.page_size
                t0 = time.perf_counter()
                self._raw_map(addr, pages[start], length)
                self._stats.map_seconds += time.perf_counter() - t0
                self._stats.map_calls += 1
                for i in range(start, start + length):
                    res.mapped[first + i] = pages[i]
                    self._map_count[pages[i]] += 1
                self._stats.pages_mapped += length
                self._stats.peak_pages_mapped = max(self._stats.peak_pages_mapped, self._stats.pages_mapped)

    def unmap(self, res: Reservation, offset: int, num_pages: int = 1) -> list[int]:
        """Unmap num_pages pages of res from offset; returns the pool pages that were there."""
        with self._lock:
            self._check_reservation(res)
            num_pages = as_int(num_pages, "num_pages")
            first = self._page_index(res, offset, num_pages)
            for i in range(first, first + num_pages):
                if i not in res.mapped:
                    raise NotMappedError(f"offset {i * self.page_size:#x} is not mapped")
            pages = [res.mapped[i] for i in range(first, first + num_pages)]
            self._unmap_run(res, first, num_pages)
            return pages

    def _unmap_run(self, res: Reservation, first: int, num_pages: int) -> None:
        chunks = [(0, num_pages)] if self.merges_runs else [(i, 1) for i in range(num_pages)]
        for start, length in chunks:
            t0 = time.perf_counter()
            self._raw_unmap(res.base + (first + start) * self.page_size, length)
            self._stats.unmap_seconds += time.perf_counter() - t0
            self._stats.unmap_calls += 1
            for i in range(first + start, first + start + length):
                self._map_count[res.mapped.pop(i)] -= 1
            self._stats.pages_mapped -= length

    def is_mapped(self, res: Reservation, offset: int, nbytes: int) -> bool:
        """True when every page touched by [offset, offset+nbytes) is mapped."""
        with self._lock:
            self._check_reservation(res)
            offset, nbytes = self._check_byte_range(res, offset, nbytes)
            if nbytes == 0:
                return True
            first, last = offset // self.page_size, (offset + nbytes - 1) // self.page_size
            return all(i in res.mapped for i in range(first, last + 1))

    # ------------------------------------------------------------------ views
    def view(
        self,
        res: Reservation,
        dtype: torch.dtype,
        shape: Sequence[int],
        offset: int = 0,
        require_mapped: bool | None = None,
    ) -> torch.Tensor:
        """A zero-copy tensor of `shape` over res starting at byte offset.

        Touching an unmapped page through the view kills the process (SIGSEGV on the
        host, an illegal address on the GPU); no check can run inside a kernel. In debug
        mode (or with require_mapped=True) the whole range is verified first.
        """
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        shape = tuple(as_int(d, "shape dimension") for d in shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"shape {shape} has a negative dimension")
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = itemsize
        for d in shape:
            nbytes *= d
        offset = as_int(offset, "offset")
        with self._lock:
            self._check_reservation(res)
            if offset < 0 or offset % itemsize or offset + nbytes > res.size:
                raise InvalidOffsetError(
                    f"view of {nbytes} bytes at offset {offset} is misaligned for {dtype} or does not "
                    f"fit a {res.size}-byte reservation"
                )
            if nbytes == 0:
                return torch.empty(shape, dtype=dtype, device=self.device)
            check = self.debug if require_mapped is None else require_mapped
            if check and not self.is_mapped(res, offset, nbytes):
                raise NotMappedError(f"view [{offset}, {offset + nbytes}) covers unmapped pages")
            raw = self._raw_view(res.base + offset, nbytes)
            return raw.view(dtype).view(shape)

    def assert_mapped(self, res: Reservation, offset: int, nbytes: int) -> None:
        """Debug check a layout runs before handing a range to a kernel."""
        if not self.is_mapped(res, offset, nbytes):
            raise NotMappedError(f"range [{offset}, {offset + nbytes}) of a reservation is not fully mapped")

    # -------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Unmap and release every reservation, then free the pool. Idempotent.

        Views taken earlier must not be touched afterwards: their memory is gone.
        """
        with self._lock:
            if self._closed:
                return
            for res in list(self._reservations):
                self.release(res)
            self._raw_close()
            self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> MemoryDriver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------- validation
    def _check_open(self) -> None:
        if self._closed:
            raise DriverClosedError(f"{type(self).__name__} is closed")

    def _check_reservation(self, res: Reservation) -> None:
        self._check_open()
        if not isinstance(res, Reservation):
            raise TypeError(f"expected a Reservation, got {type(res).__name__}")
        if res.released:
            raise InvalidOffsetError("reservation was released")
        if res not in self._reservations:
            raise InvalidOffsetError("reservation belongs to another driver")

    def _check_pool_index(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise PageStateError(f"page {page} is not in the pool [0, {self.num_pages})")

    def _check_page(self, page: object) -> int:
        """An allocated pool page id as a Python int."""
        page = as_int(page, "page")
        self._check_pool_index(page)
        if not self._allocated[page]:
            raise PageStateError(f"page {page} is not allocated")
        return page

    def _check_byte_range(self, res: Reservation, offset: object, nbytes: object) -> tuple[int, int]:
        offset, nbytes = as_int(offset, "offset"), as_int(nbytes, "nbytes")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if offset < 0 or offset + nbytes > res.size:
            raise InvalidOffsetError(
                f"bytes [{offset}, {offset + nbytes}) fall outside a {res.size}-byte reservation"
            )
        return offset, nbytes

    def _page_index(self, res: Reservation, offset: object, num_pages: object) -> int:
        offset, num_pages = as_int(offset, "offset"), as_int(num_pages, "num_pages")
        if offset % self.page_size:
            raise InvalidOffsetError(f"offset {offset} is not a multiple of the page size {self.page_size}")
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if offset < 0 or offset + num_pages * self.page_size > res.size:
            raise InvalidOffsetError(
                f"pages [{offset:#x}, {offset + num_pages * self.page_size:#x}) fall outside a "
                f"{res.size:#x}-byte reservation"
            )
        return offset // self.page_size
