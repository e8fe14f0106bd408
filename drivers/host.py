"""HostDriver: real virtual memory on Linux CPUs through memfd + mmap.

The pool is one memfd; mapping places pool pages into a PROT_NONE reservation with
MAP_SHARED|MAP_FIXED; unmapping swaps a fresh PROT_NONE reservation back in with
MAP_FIXED, so the range is never a hole another mmap could take.

With pages that are whole huge pages (2 MiB on x86), reservations start on a huge-page
boundary and every mapping asks for transparent huge pages (madvise MADV_HUGEPAGE) before it
is first touched, so where the kernel lets shared memory have them (shmem_huge_pages()) one
TLB entry covers a page, as on a GPU. Where it does not ("never", the common default), and for
smaller pages whose runs fill a huge page, the driver collapses what it maps into huge pages
(MADV_COLLAPSE, Linux 6.1+, which that policy does not forbid): a 2 MiB page the first time it
is mapped, and a run of 64 KiB pages once it fills an aligned 2 MiB of the memfd, mapped in
order at an aligned address (`huge_run`; vattention's layer-packed slots keep their runs so).
A layer-packed K/V row of a token sits 23 KB after the previous one, so at 4 KiB OS pages
every token of a layer is a TLB miss (docs/vattention.md).

zeros_on_huge_pages() gives tensors that no driver maps (the paged layout's block pool) the same
huge pages on private memory, which most kernels grant where shared memory gets none.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import math
import mmap
import os
import sys
from collections.abc import Sequence

import torch

from .base import MemoryDriver, Reservation, as_int
from .errors import DriverUnavailableError, HostMemoryError, RawCallError

PROT_NONE = 0x0
PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
MAP_SHARED = 0x01
MAP_PRIVATE = 0x02
MAP_FIXED = 0x10
MAP_ANONYMOUS = 0x20
MAP_NORESERVE = 0x4000
MAP_POPULATE = 0x8000
MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23  # Linux 5.14+
MADV_COLLAPSE = 25  # Linux 6.1+
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
MAP_FAILED = ctypes.c_void_p(-1).value

DEFAULT_PAGE_SIZE = 64 * 1024
THP_SYSFS = "/sys/kernel/mm/transparent_hugepage"


def _sysfs_choice(path: str) -> str:
    """The bracketed choice of a sysfs selector ("always [advise] never" -> "advise"), or ""."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return ""
    return text[text.find("[") + 1 : text.find("]")] if "[" in text else text.strip()


def huge_page_size() -> int:
    """The size of a PMD-mapped transparent huge page (2 MiB on x86-64), 0 without THP."""
    try:
        with open(f"{THP_SYSFS}/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


def shmem_huge_pages() -> bool:
    """True when the kernel gives shared memory (a memfd) huge pages for an madvise'd range.

    The global shmem_enabled policy decides unless the per-size one overrides it ("inherit");
    "never" is the common default, and then pages stay 4 KiB whatever the driver asks.
    """
    size = huge_page_size()
    if not size:
        return False
    per_size = _sysfs_choice(f"{THP_SYSFS}/hugepages-{size // 1024}kB/shmem_enabled")
    policy = _sysfs_choice(f"{THP_SYSFS}/shmem_enabled") if per_size in ("", "inherit") else per_size
    return policy in ("always", "within_size", "advise", "force")


def anon_huge_pages() -> bool:
    """True when the kernel gives private anonymous memory huge pages for an madvise'd range
    ("always" or "madvise", the common default; a per-size policy overrides unless "inherit")."""
    size = huge_page_size()
    if not size:
        return False
    per_size = _sysfs_choice(f"{THP_SYSFS}/hugepages-{size // 1024}kB/enabled")
    policy = _sysfs_choice(f"{THP_SYSFS}/enabled") if per_size in ("", "inherit") else per_size
    return policy in ("always", "madvise")


def memory_info() -> tuple[int, int] | None:
    """(available, total) bytes of this machine's memory: /proc/meminfo's MemAvailable (what can
    be allocated without swapping) and MemTotal; None where that file is not (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:]}
        return info["MemAvailable"], info["MemTotal"]
    except (OSError, KeyError, ValueError):
        return None


def require_available(nbytes: int, what: str) -> None:
    """Raise HostMemoryError if `what`, nbytes to be backed now, is more than the machine has
    available. Why before: past that, populating does not fail, the OOM killer ends the process."""
    info = memory_info()
    if info is not None and nbytes > info[0]:
        raise HostMemoryError(what, nbytes, info[0])


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor on private memory that asks for transparent huge pages, populated now.

    Why: the paged decode kernel reads 6 KiB blocks in the order of each block table, so on 4 KiB
    OS pages nearly every block is a TLB miss the hardware prefetcher cannot run ahead of. On
    2 MiB pages the scattered pool read 1.13-1.46x faster at batch 64 x 2,048 tokens on a Zen 4
    EPYC (docs/paging.md). Populated here, as torch.zeros would be, so no step takes the first
    touch. Where the OS gives no huge pages this is torch.zeros.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = itemsize * math.prod(shape)
    huge = huge_page_size()
    if not nbytes or not huge or not sys.platform.startswith("linux"):
        return torch.zeros(shape, dtype=dtype)
    # over-reserve by one huge page so the tensor starts on a huge-page boundary; the unused
    # head and tail are never touched, so they take no memory
    memory = mmap.mmap(-1, nbytes + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(memory, dtype=torch.uint8)  # keeps `memory` alive while viewed
    start = -whole.data_ptr() % huge
    with contextlib.suppress(OSError):  # advice: before the first touch, or pages stay 4 KiB
        memory.madvise(MADV_HUGEPAGE, start, nbytes)
    tensor = whole[start : start + nbytes].view(dtype).view(shape)
    try:
        memory.madvise(MADV_POPULATE_WRITE, start, nbytes)
    except OSError:  # Linux < 5.14: touch every page instead
        tensor.zero_()
    return tensor


def _load_libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.restype = ctypes.c_int
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.fallocate.restype = ctypes.c_int
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    return libc


_libc = _load_libc() if sys.platform.startswith("linux") else None


def _errno_error(what: str) -> RawCallError:
    err = ctypes.get_errno()
    return RawCallError(err, f"{what} failed: {os.strerror(err)}")


class HostDriver(MemoryDriver):
    """Physical pages from one memfd, mapped into reserved virtual ranges on demand.

    page_size: any multiple of the OS page size (default 64 KiB; 2 MiB works, and a multiple of
        the huge page size asks for huge pages: `huge_pages`).
    populate: pre-fault pages when mapping so first touch does not fault.
    preallocate: back the whole pool up front so mapping never finds the machine out of memory
        later, nor allocates: as huge pages where map() would collapse them (`huge_run`).
    """

    device = torch.device("cpu")

    def __init__(
        self,
        num_pages: int,
        page_size: int = DEFAULT_PAGE_SIZE,
        populate: bool = False,
        preallocate: bool = False,
        debug: bool = False,
    ) -> None:
        if _libc is None:
            raise DriverUnavailableError("HostDriver needs Linux (memfd_create and mmap MAP_FIXED)")
        os_page = mmap.PAGESIZE
        page_size = as_int(page_size, "page_size")
        if page_size <= 0 or page_size % os_page:
            raise ValueError(
                f"page_size must be a positive multiple of the OS page size {os_page}, got {page_size}"
            )
        super().__init__(page_size, num_pages, debug)
        if preallocate:
            require_available(num_pages * page_size, "a preallocated pool")
        self.populate = populate
        huge = huge_page_size()
        self.huge_pages = bool(huge) and page_size % huge == 0  # asked for; shmem_huge_pages() grants
        # A run of pool pages that fills an aligned huge page of the memfd, mapped in order at an
        # address aligned the same way, is collapsed into one huge page (populated pages only).
        # Faults already map huge pages where shmem_huge_pages() says so, but only into mappings
        # that cover a whole huge page: never into runs mapped a few small pages at a time.
        fits = bool(huge) and (page_size % huge == 0 or huge % page_size == 0)
        granted = self.huge_pages and shmem_huge_pages()
        self.huge_run = max(huge, page_size) if fits and populate and not granted else 0
        self._run_pages = max(1, self.huge_run // page_size)
        self.huge_extents: set[int] = set()  # runs (pool page // _run_pages) collapsed, not punched since
        self._align = huge if self.huge_pages or self.huge_run else os_page
        self._fd = os.memfd_create("vmkv-pool", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, num_pages * page_size)
            if preallocate:
                self._back_pool()
        except (OSError, RawCallError):
            os.close(self._fd)
            raise
        self.preallocated = preallocate

    def _back_pool(self) -> None:
        """Back every pool page now: each huge-page run collapsed the way map() would (through
        a mapping of the whole memfd, dropped after), the rest, where collapsing stopped or
        nothing collapses, by posix_fallocate at small pages.

        Why: memory a machine touches for the first time is its dearest (in a virtual machine
        the host backs it then too): ~4 ms of mapper CPU per 2 MiB collapse while an engine
        stepped, against 0.27 ms for memory used before, and at 64 prompts at once that was
        vattention's whole distance to the paged pool, which is populated at start
        (docs/vattention.md, "Backing the pool up front")."""
        size = self.num_pages * self.page_size
        if self.huge_run:
            addr = self._raw_reserve(size)
            try:
                self._mmap(addr, size, PROT_RW, MAP_SHARED | MAP_FIXED, self._fd, 0, "map")
                _libc.madvise(addr, size, MADV_HUGEPAGE)
                for offset in range(0, size - self.huge_run + 1, self.huge_run):
                    self._collapse(addr + offset, offset // self.huge_run, fresh=True)
                    if not self.huge_run:
                        break
            finally:
                self._raw_release(addr, size)
        os.posix_fallocate(self._fd, 0, size)

    def _mmap(self, addr: int, size: int, prot: int, flags: int, fd: int, off: int, what: str) -> int:
        got = _libc.mmap(addr or None, size, prot, flags, fd, off)
        if got == MAP_FAILED or got is None:
            raise _errno_error(what)
        if addr and got != addr:  # MAP_FIXED never moves; guard anyway
            raise RawCallError(0, f"{what} placed memory at {got:#x} instead of {addr:#x}")
        return got

    def _raw_reserve(self, size: int) -> int:
        """A PROT_NONE range starting on a multiple of self._align (over-reserve, trim the ends)."""
        extra = self._align - mmap.PAGESIZE
        flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE
        base = self._mmap(0, size + extra, PROT_NONE, flags, -1, 0, "reserve")
        start = -(-base // self._align) * self._align
        for addr, length in ((base, start - base), (start + size, base + extra - start)):
            if length:
                self._raw_release(addr, length)
        return start

    def _raw_release(self, base: int, size: int) -> None:
        if _libc.munmap(base, size):
            raise _errno_error("munmap")

    def _raw_map(self, addr: int, first_page: int, num_pages: int) -> None:
        size, offset = num_pages * self.page_size, first_page * self.page_size
        eager = self.populate and not self.huge_run  # else map() populates, after collapsing
        if not self.huge_pages:
            flags = MAP_SHARED | MAP_FIXED | (MAP_POPULATE if eager else 0)
            self._mmap(addr, size, PROT_RW, flags, self._fd, offset, "map")
            return
        # The huge-page hint must precede the first touch, so populate after it. The hint is
        # advice: a kernel without THP refuses it and the mapping stays at 4 KiB pages.
        self._mmap(addr, size, PROT_RW, MAP_SHARED | MAP_FIXED, self._fd, offset, "map")
        _libc.madvise(addr, size, MADV_HUGEPAGE)
        if eager and _libc.madvise(addr, size, MADV_POPULATE_WRITE):
            flags = MAP_SHARED | MAP_FIXED | MAP_POPULATE  # refused (Linux < 5.14): 4 KiB pages
            self._mmap(addr, size, PROT_RW, flags, self._fd, offset, "map")

    def map(self, res: Reservation, offset: int, pages: Sequence[int]) -> None:
        with self._lock:  # one hold (the lock is reentrant): no unmap or release in between
            collapsing = self.huge_run  # _raw_map left populating to _populate_runs
            super().map(res, offset, pages)
            if collapsing:
                self._populate_runs(res, as_int(offset, "offset") // self.page_size, len(pages))

    def _populate_runs(self, res: Reservation, first: int, count: int) -> None:
        """Populate pages first..first+count-1 of res, first collapsing each huge page they
        complete with one aligned run of the memfd.

        A run not collapsed before is collapsed before its new pages are touched: the kernel
        fills what the memfd lacks from the zeroed huge page it allocates, so those pages are
        neither faulted in at 4 KiB nor copied (0.27 ms per 2 MiB on a Zen 4 EPYC, against
        1.8 ms populated first: docs/drivers.md). Collapsing wants one page of the run present,
        so its first OS page is touched. A run collapsed before takes ~0.14 ms (its mapping
        becomes one huge-page entry).

        Advice: a refusal other than EAGAIN (busy) stops every later try. A kernel without
        MADV_COLLAPSE refuses them all, and one short of free 2 MiB memory would reclaim and
        compact memory on every map call (collapsing does both whatever the defrag policy says).
        """
        per = self._run_pages
        for start in range(first - first % per, first + count, per):
            head = res.mapped.get(start)
            if not self.huge_run or head is None or head % per:
                continue
            if any(res.mapped.get(start + i) != head + i for i in range(1, per)):
                continue
            fresh = head // per not in self.huge_extents
            if fresh or per > 1:  # a whole collapsed run of one page: populating maps the huge page
                self._collapse(res.base + start * self.page_size, head // per, fresh)
        if _libc.madvise(res.base + first * self.page_size, count * self.page_size, MADV_POPULATE_WRITE):
            self.huge_run = 0  # refused (Linux < 5.14): map again, populated, at 4 KiB pages
            for i in range(first, first + count):
                self._raw_map(res.base + i * self.page_size, res.mapped[i], 1)

    def _collapse(self, addr: int, run: int, fresh: bool) -> None:
        """Collapse the huge page at addr, memfd run `run`, into one huge page. A fresh run (not
        collapsed before) first gets its first OS page touched: collapsing wants one present,
        and fills the rest from the zeroed huge page. A refusal other than EAGAIN (busy) sets
        huge_run to 0, which stops every later try."""
        if fresh:
            _libc.madvise(addr, mmap.PAGESIZE, MADV_POPULATE_WRITE)
        if _libc.madvise(addr, self.huge_run, MADV_COLLAPSE) == 0:
            self.huge_extents.add(run)
        elif ctypes.get_errno() != errno.EAGAIN:
            self.huge_run = 0

    def _raw_unmap(self, addr: int, num_pages: int) -> None:
        self._mmap(
            addr,
            num_pages * self.page_size,
            PROT_NONE,
            MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
            -1,
            0,
            "unmap",
        )

    def _raw_view(self, addr: int, nbytes: int) -> torch.Tensor:
        buf = (ctypes.c_uint8 * nbytes).from_address(addr)
        return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)

    def _raw_punch(self, page: int) -> None:
        mode = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
        if _libc.fallocate(self._fd, mode, page * self.page_size, self.page_size):
            raise _errno_error("fallocate(PUNCH_HOLE)")
        self.huge_extents.discard(page // self._run_pages)

    def _raw_close(self) -> None:
        os.close(self._fd)
