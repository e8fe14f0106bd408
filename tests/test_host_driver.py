"""HostDriver on real memory: memfd pages mapped into PROT_NONE reservations, no mocks."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import signal
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from vmkv.drivers import (
    AlreadyMappedError,
    DriverClosedError,
    HostDriver,
    HostMemoryError,
    InvalidOffsetError,
    NotMappedError,
    PageStateError,
    PoolExhaustedError,
    anon_huge_pages,
    host,
    huge_page_size,
    memory_info,
    shmem_huge_pages,
    zeros_on_huge_pages,
)

PS = 64 * 1024
MIB2 = 2 * 1024 * 1024


@pytest.fixture
def driver():
    d = HostDriver(num_pages=8, page_size=PS)
    yield d
    d.close()


def page_view(d: HostDriver, res, index: int) -> torch.Tensor:
    return d.view(res, torch.uint8, (d.page_size,), offset=index * d.page_size)


def vma(addr: int, kind: str = "maps") -> tuple[str, dict[str, int]]:
    """Permissions of the mapping holding addr in /proc/self/maps, and its smaps fields (kB)."""
    with open(f"/proc/self/{kind}") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        head = line.split()
        if "-" not in head[0] or ":" in head[0]:
            continue
        start, end = (int(x, 16) for x in head[0].split("-"))
        if start <= addr < end:
            fields = {}
            for extra in lines[i + 1 :]:
                key, _, rest = extra.partition(":")
                if "-" in key:  # next mapping's header
                    break
                if rest.strip().endswith("kB"):
                    fields[key] = int(rest.split()[0])
            return head[1], fields
    raise AssertionError(f"address {addr:#x} is in no mapping")


# ------------------------------------------------------------------ semantics
def test_one_physical_page_aliases_at_two_offsets(driver):
    res = driver.reserve(4 * PS)
    (page,) = driver.alloc(1)
    driver.map(res, 0, [page])
    driver.map(res, 3 * PS, [page])
    assert driver.map_count(page) == 2
    page_view(driver, res, 0)[:] = 0xAB
    assert bool((page_view(driver, res, 3) == 0xAB).all())
    page_view(driver, res, 3)[100] = 7
    assert int(page_view(driver, res, 0)[100]) == 7


def test_alias_across_two_reservations(driver):
    a, b = driver.reserve(PS), driver.reserve(2 * PS)
    (page,) = driver.alloc(1)
    driver.map(a, 0, [page])
    driver.map(b, PS, [page])
    page_view(driver, a, 0).view(torch.int64)[:] = 123456789
    assert bool((page_view(driver, b, 1).view(torch.int64) == 123456789).all())


def test_remap_changes_what_an_existing_view_sees(driver):
    res = driver.reserve(2 * PS)
    p, q = driver.alloc(2)
    driver.map(res, 0, [p])
    driver.map(res, PS, [q])
    page_view(driver, res, 0)[:] = 1
    page_view(driver, res, 1)[:] = 2
    existing = driver.view(res, torch.uint8, (2, PS))
    assert existing[0, 0] == 1 and existing[1, 0] == 2
    assert driver.unmap(res, 0) == [p]
    driver.map(res, 0, [q])
    assert bool((existing[0] == 2).all())
    existing[0, 5] = 9
    assert int(existing[1, 5]) == 9


def test_pool_exhaustion_raises_counts_and_driver_stays_usable(driver):
    pages = driver.alloc(6)
    with pytest.raises(PoolExhaustedError) as info:
        driver.alloc(3)
    assert (info.value.requested, info.value.free, info.value.total) == (3, 2, 8)
    assert isinstance(info.value, MemoryError)
    assert driver.stats.exhaustion_events == 1
    assert driver.free_page_count == 2  # all or none: nothing was taken
    more = driver.alloc(2)
    assert sorted(pages + more) == list(range(8))
    with pytest.raises(PoolExhaustedError):
        driver.alloc(1)
    assert driver.stats.exhaustion_events == 2
    driver.free(more)
    res = driver.reserve(PS)
    driver.map(res, 0, driver.alloc(1))
    page_view(driver, res, 0)[0] = 5
    assert int(page_view(driver, res, 0)[0]) == 5


def test_unmapped_page_is_prot_none_again(driver):
    res = driver.reserve(3 * PS)
    driver.map(res, PS, driver.alloc(1))
    assert vma(res.base + PS)[0] == "rw-s"
    assert vma(res.base)[0] == "---p"
    driver.unmap(res, PS)
    for i in range(3):
        assert vma(res.base + i * PS)[0] == "---p"


def test_touching_an_unmapped_page_through_a_view_dies_by_sigsegv():
    child = textwrap.dedent(
        """
        import torch
        from vmkv.drivers import HostDriver
        d = HostDriver(num_pages=2, page_size=64 * 1024)
        res = d.reserve(2 * 64 * 1024)
        d.map(res, 0, d.alloc(1))
        v = d.view(res, torch.uint8, (64 * 1024,))
        v[0] = 1
        print("mapped write ok", flush=True)
        d.unmap(res, 0)
        v[0] = 2
        print("survived", flush=True)
        """
    )
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert out.returncode == -signal.SIGSEGV, out.stderr
    assert "mapped write ok" in out.stdout and "survived" not in out.stdout


def test_counters_are_exact_after_a_scripted_sequence(driver):
    res = driver.reserve(8 * PS)
    pages = driver.alloc(4)
    assert pages == [0, 1, 2, 3]
    driver.map(res, 0, pages)  # physically consecutive: one call
    assert driver.stats.map_calls == 1
    driver.map(res, 4 * PS, [3, 1, 2])  # runs [3], [1, 2]: two calls; 3 and 1, 2 alias
    s = driver.stats
    assert (s.map_calls, s.pages_mapped, s.peak_pages_mapped) == (3, 7, 7)
    assert [driver.map_count(p) for p in pages] == [1, 2, 2, 2]
    assert driver.unmap(res, 0, 4) == pages  # one call even across separate mappings
    assert driver.unmap(res, 5 * PS, 1) == [1]
    with pytest.raises(PoolExhaustedError):
        driver.alloc(5)
    s = driver.stats
    assert (s.map_calls, s.unmap_calls, s.pages_mapped, s.peak_pages_mapped) == (3, 2, 2, 7)
    assert s.exhaustion_events == 1 and s.pages_punched == 0
    assert s.map_seconds > 0 and s.unmap_seconds > 0
    driver.release(res)  # the two remaining pages [3, 2] at offsets 4 and 6: two runs, two calls
    s = driver.stats
    assert (s.unmap_calls, s.pages_mapped) == (4, 0)
    driver.free(pages, punch=True)
    assert driver.stats.pages_punched == 4 and driver.free_page_count == 8


class RecordingHostDriver(HostDriver):
    """A real HostDriver that also records every raw map call it issues."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.raw_maps: list[tuple[int, int, int]] = []

    def _raw_map(self, addr: int, first_page: int, num_pages: int) -> None:
        self.raw_maps.append((addr, first_page, num_pages))
        super()._raw_map(addr, first_page, num_pages)


def test_contiguous_run_maps_in_one_call():
    with RecordingHostDriver(num_pages=8, page_size=PS) as d:
        res = d.reserve(8 * PS)
        d.map(res, 0, d.alloc(4))
        assert d.raw_maps == [(res.base, 0, 4)]
        assert d.alloc(4) == [4, 5, 6, 7]
        d.map(res, 4 * PS, [6, 7, 5])
        assert d.raw_maps[1:] == [(res.base + 4 * PS, 6, 2), (res.base + 6 * PS, 5, 1)]
        assert d.stats.map_calls == 3
        assert bool((d.view(res, torch.uint8, (7 * PS,)) == 0).all())


def test_threads_share_a_driver_and_counters_stay_exact(driver):
    res = driver.reserve(8 * PS)
    pages = driver.alloc(4)
    cycles = 200

    def worker(slot: int) -> None:
        for _ in range(cycles):
            driver.map(res, slot * PS, [pages[slot]])
            assert driver.is_mapped(res, slot * PS, PS)
            page_view(driver, res, slot)[0] = slot + 1
            driver.unmap(res, slot * PS)

    with ThreadPoolExecutor(4) as pool:
        for done in [pool.submit(worker, slot) for slot in range(4)]:
            done.result()  # re-raises a worker's failure here
    s = driver.stats
    assert (s.map_calls, s.unmap_calls, s.pages_mapped) == (4 * cycles, 4 * cycles, 0)
    assert 1 <= s.peak_pages_mapped <= 4 and res.mapped == {}
    driver.map(res, 0, pages)
    assert page_view(driver, res, 0)[0].item() == 1 and page_view(driver, res, 3)[0].item() == 4


# ------------------------------------------------------------------ wrong use
def test_offsets_outside_the_range_or_misaligned(driver):
    res = driver.reserve(2 * PS)
    pages = driver.alloc(2)
    for offset in (-PS, 2 * PS, 100 * PS):
        with pytest.raises(InvalidOffsetError):
            driver.map(res, offset, pages[:1])
    with pytest.raises(InvalidOffsetError):
        driver.map(res, PS, pages)  # runs past the end
    with pytest.raises(InvalidOffsetError):
        driver.map(res, 4096, pages[:1])
    with pytest.raises(InvalidOffsetError):
        driver.unmap(res, 3)
    with pytest.raises(InvalidOffsetError):
        driver.is_mapped(res, PS, 2 * PS)
    assert driver.stats.map_calls == 0 and res.mapped == {}


def test_map_over_a_mapped_offset_changes_nothing(driver):
    res = driver.reserve(4 * PS)
    a, b, c = driver.alloc(3)
    driver.map(res, PS, [a])
    with pytest.raises(AlreadyMappedError):
        driver.map(res, 0, [b, c])  # the first offset is free, the second is not
    assert res.mapped == {1: a} and driver.stats.map_calls == 1
    assert vma(res.base)[0] == "---p"
    assert [driver.map_count(p) for p in (a, b, c)] == [1, 0, 0]


def test_unmap_of_an_unmapped_offset_changes_nothing(driver):
    res = driver.reserve(4 * PS)
    driver.map(res, 0, driver.alloc(1))
    with pytest.raises(NotMappedError):
        driver.unmap(res, PS)
    with pytest.raises(NotMappedError):
        driver.unmap(res, 0, 2)  # the first page is mapped, the second is not
    assert res.mapped == {0: 0} and driver.stats.unmap_calls == 0
    assert vma(res.base)[0] == "rw-s"


def test_page_state_errors(driver):
    res = driver.reserve(2 * PS)
    with pytest.raises(PageStateError):
        driver.map(res, 0, [0])  # not allocated
    with pytest.raises(PageStateError):
        driver.map(res, 0, [8])  # outside the pool
    with pytest.raises(PageStateError):
        driver.map(res, 0, [-1])
    (p,) = driver.alloc(1)
    driver.map(res, 0, [p])
    with pytest.raises(PageStateError):
        driver.free([p])  # still mapped
    driver.unmap(res, 0)
    with pytest.raises(PageStateError):
        driver.free([p, p])
    driver.free([p])
    with pytest.raises(PageStateError):
        driver.free([p])  # double free
    assert driver.free_page_count == 8


def test_reservation_errors(driver):
    res = driver.reserve(PS)
    driver.release(res)
    for call in (
        lambda: driver.map(res, 0, driver.alloc(1)),
        lambda: driver.unmap(res, 0),
        lambda: driver.view(res, torch.uint8, (1,)),
        lambda: driver.release(res),
    ):
        with pytest.raises(InvalidOffsetError):
            call()
    with HostDriver(num_pages=1, page_size=PS) as other:
        foreign = other.reserve(PS)
        with pytest.raises(InvalidOffsetError):
            driver.unmap(foreign, 0)
    for size in (0, -PS):
        with pytest.raises(ValueError):
            driver.reserve(size)
    with pytest.raises(ValueError):
        driver.reserve(2**64)  # would wrap to a tiny size_t in mmap
    with pytest.raises(TypeError):
        driver.reserve(1.5)


def test_integer_types_are_accepted_and_non_integers_refused(driver):
    res = driver.reserve(np.int64(2 * PS))
    pages = np.array(driver.alloc(2), dtype=np.int64)
    driver.map(res, np.int64(0), pages)
    assert res.mapped == {0: 0, 1: 1} and all(type(p) is int for p in res.mapped.values())
    assert driver.unmap(res, torch.tensor(PS)) == [1]
    for bad in (True, 1.0, "1"):
        with pytest.raises(TypeError):
            driver.map(res, PS, [bad])
    with pytest.raises(TypeError):
        driver.map(res, float(PS), [1])
    with pytest.raises(TypeError):
        driver.alloc(1.0)
    assert res.mapped == {0: 0}


def test_view_checks_dtype_shape_offset_and_size(driver):
    res = driver.reserve(2 * PS)
    driver.map(res, 0, driver.alloc(2))
    v = driver.view(res, torch.float32, (2, PS // 8), offset=4)
    assert v.shape == (2, PS // 8) and v.dtype == torch.float32
    assert v.data_ptr() == res.base + 4
    assert driver.view(res, torch.float16, (0, 3)).numel() == 0
    with pytest.raises(InvalidOffsetError):
        driver.view(res, torch.float32, (4,), offset=2)  # misaligned for 4-byte elements
    with pytest.raises(InvalidOffsetError):
        driver.view(res, torch.uint8, (2 * PS + 1,))
    with pytest.raises(InvalidOffsetError):
        driver.view(res, torch.uint8, (1,), offset=-1)
    with pytest.raises(ValueError):
        driver.view(res, torch.uint8, (-1,))
    with pytest.raises(TypeError):
        driver.view(res, np.float32, (4,))


def test_debug_mode_refuses_views_over_unmapped_pages():
    with HostDriver(num_pages=2, page_size=PS, debug=True) as d:
        res = d.reserve(2 * PS)
        d.map(res, 0, d.alloc(1))
        assert d.view(res, torch.uint8, (PS,)).shape == (PS,)
        with pytest.raises(NotMappedError):
            d.view(res, torch.uint8, (PS + 1,))
        assert d.view(res, torch.uint8, (PS + 1,), require_mapped=False).shape == (PS + 1,)  # not touched
        d.assert_mapped(res, 0, PS)
        with pytest.raises(NotMappedError):
            d.assert_mapped(res, PS - 1, 2)
        assert d.is_mapped(res, PS, 0)
    with HostDriver(num_pages=1, page_size=PS) as d:
        res = d.reserve(PS)
        with pytest.raises(NotMappedError):
            d.view(res, torch.uint8, (PS,), require_mapped=True)


def test_closed_driver_refuses_everything():
    d = HostDriver(num_pages=2, page_size=PS)
    res = d.reserve(PS)
    d.map(res, 0, d.alloc(1))
    d.close()
    d.close()  # idempotent
    assert d.closed and res.released
    calls = [
        lambda: d.reserve(PS),
        lambda: d.alloc(1),
        lambda: d.free([0]),
        lambda: d.map(res, 0, [0]),
        lambda: d.unmap(res, 0),
        lambda: d.view(res, torch.uint8, (1,)),
        lambda: d.is_mapped(res, 0, 1),
        lambda: d.release(res),
    ]
    for call in calls:
        with pytest.raises(DriverClosedError):
            call()


def test_bad_construction():
    for page_size in (0, 1000, mmap.PAGESIZE + 1):
        with pytest.raises(ValueError):
            HostDriver(num_pages=1, page_size=page_size)
    with pytest.raises(ValueError):
        HostDriver(num_pages=0)
    with pytest.raises(ValueError):
        HostDriver(num_pages=2**62, page_size=PS)


# ------------------------------------------------------------------ options
def test_two_mib_pages():
    with HostDriver(num_pages=3, page_size=MIB2) as d:
        res = d.reserve(4 * MIB2)
        a, b, c = d.alloc(3)
        d.map(res, 0, [a, b])
        d.map(res, 3 * MIB2, [a])
        v = d.view(res, torch.int32, (4, MIB2 // 4))
        v[0] = 11
        v[1] = 22
        assert bool((v[3] == 11).all()) and int(v[1, -1]) == 22
        d.unmap(res, 0)
        d.map(res, 0, [c])
        assert bool((v[0] == 0).all())
        assert vma(res.base + 2 * MIB2)[0] == "---p"


def vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping holding addr ("hg": madvise(MADV_HUGEPAGE) was asked)."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    inside = False
    for line in lines:
        head = line.split()
        if "-" in head[0] and ":" not in head[0]:
            start, end = (int(x, 16) for x in head[0].split("-"))
            inside = start <= addr < end
        elif inside and line.startswith("VmFlags:"):
            return head[1:]
    raise AssertionError(f"address {addr:#x} is in no mapping")


def vmstat(counter: str) -> int:
    """A kernel counter: thp_file_fallback (huge pages wanted for files, shmem included, but not
    allocated), thp_fault_fallback (the same for private memory)."""
    with open("/proc/vmstat") as f:
        counters = dict(line.split() for line in f)
    return int(counters.get(counter, 0))


@pytest.mark.skipif(huge_page_size() != MIB2, reason="the kernel has no 2 MiB transparent huge pages")
def test_huge_page_sized_pages_ask_for_huge_pages_and_get_them_where_granted():
    with HostDriver(num_pages=2, page_size=MIB2, populate=True) as d:
        assert d.huge_pages
        res = d.reserve(3 * MIB2)
        assert res.base % MIB2 == 0  # a huge page must start on a huge-page boundary
        fallbacks = vmstat("thp_file_fallback")
        d.map(res, MIB2, d.alloc(1))
        assert "hg" in vm_flags(res.base + MIB2)
        _, fields = vma(res.base + MIB2, "smaps")
        assert fields["Rss"] == MIB2 // 1024  # populated before the first touch
        # shmem_enabled decides at the fault: granted, the kernel maps a huge page, or counts a
        # fallback when it finds no free 2 MiB of memory. Under "never" (a common default) the
        # driver collapses the populated page instead, where the kernel can (Linux 6.1+).
        huge = fields["ShmemPmdMapped"] == MIB2 // 1024
        if shmem_huge_pages():
            assert huge or vmstat("thp_file_fallback") > fallbacks
        else:
            assert huge == (res.mapped[1] in d.huge_extents)
        v = d.view(res, torch.int64, (MIB2 // 8,), offset=MIB2)
        v[:] = 7
        assert int(v.sum()) == 7 * MIB2 // 8
    with HostDriver(num_pages=2, page_size=PS) as d:
        assert not d.huge_pages
        res = d.reserve(PS)
        d.map(res, 0, d.alloc(1))
        assert "hg" not in vm_flags(res.base)


@pytest.mark.skipif(
    huge_page_size() != MIB2 or shmem_huge_pages(), reason="needs 2 MiB THP that faults do not grant shmem"
)
def test_a_collapsed_pool_page_maps_huge_elsewhere_keeps_its_data_and_is_forgotten_when_punched():
    with HostDriver(num_pages=1, page_size=MIB2, populate=True) as d:
        res = d.reserve(MIB2)
        [page] = d.alloc(1)
        d.map(res, 0, [page])
        if page not in d.huge_extents:
            pytest.skip("this kernel has no MADV_COLLAPSE, or no free 2 MiB of memory now")
        d.view(res, torch.int64, (MIB2 // 8,))[:] = 5
        d.unmap(res, 0)
        other = d.reserve(MIB2)
        d.map(other, 0, [page])
        assert vma(other.base, "smaps")[1]["ShmemPmdMapped"] == MIB2 // 1024  # no collapse needed
        assert int(d.view(other, torch.int64, (MIB2 // 8,)).sum()) == 5 * MIB2 // 8
        d.unmap(other, 0)
        d.free([page], punch=True)
        assert page not in d.huge_extents  # its memory went back to the OS


@pytest.mark.skipif(
    huge_page_size() != MIB2 or shmem_huge_pages(), reason="needs 2 MiB THP that faults do not grant shmem"
)
def test_a_refused_collapse_stops_every_later_try(monkeypatch):
    real, tries = host._libc, []

    class RefusingCollapse:  # the C library, except that MADV_COLLAPSE always fails
        def __getattr__(self, name):
            return getattr(real, name)

        def madvise(self, addr, size, advice):
            if advice == host.MADV_COLLAPSE:
                tries.append(addr)
                ctypes.set_errno(errno.EINVAL)
                return -1
            return real.madvise(addr, size, advice)

    monkeypatch.setattr(host, "_libc", RefusingCollapse())
    with HostDriver(num_pages=3, page_size=MIB2, populate=True) as d:
        res = d.reserve(3 * MIB2)
        d.map(res, 0, d.alloc(2))
        d.map(res, 2 * MIB2, d.alloc(1))
        assert len(tries) == 1 and not d.huge_extents  # compaction is not retried per map
        v = d.view(res, torch.int64, (3 * MIB2 // 8,))
        v[:] = 2  # the pages work at 4 KiB
        assert int(v.sum()) == 3 * MIB2 // 4


@pytest.mark.skipif(
    huge_page_size() != MIB2 or shmem_huge_pages(), reason="needs 2 MiB THP that faults do not grant shmem"
)
def test_a_fresh_run_is_collapsed_before_its_pages_are_touched_and_reads_zero(monkeypatch):
    real, calls = host._libc, []

    class Recording:  # the C library, recording each madvise
        def __getattr__(self, name):
            return getattr(real, name)

        def madvise(self, addr, size, advice):
            calls.append((advice, addr, size))
            return real.madvise(addr, size, advice)

    monkeypatch.setattr(host, "_libc", Recording())
    with HostDriver(num_pages=32, page_size=PS, populate=True) as d:
        res = d.reserve(MIB2)
        d.map(res, 0, d.alloc(32))
        if 0 not in d.huge_extents:
            pytest.skip("this kernel has no MADV_COLLAPSE, or no free 2 MiB of memory now")
        # one OS page touched (collapsing needs one present), collapsed, then populated: the
        # kernel zero-fills the rest, so no page is faulted in at 4 KiB only to be copied
        touch, populate = (
            (host.MADV_POPULATE_WRITE, res.base, mmap.PAGESIZE),
            (host.MADV_POPULATE_WRITE, res.base, MIB2),
        )
        assert calls == [touch, (host.MADV_COLLAPSE, res.base, MIB2), populate]
        _, fields = vma(res.base, "smaps")
        assert fields["ShmemPmdMapped"] == fields["Rss"] == MIB2 // 1024
        assert int(d.view(res, torch.int64, (MIB2 // 8,)).abs().sum()) == 0


def test_a_preallocated_pool_is_backed_before_any_map_and_maps_without_allocating():
    with HostDriver(num_pages=96, page_size=PS, populate=True, preallocate=True) as d:
        assert d.preallocated and os.fstat(d._fd).st_blocks * 512 == 96 * PS  # every page backed
        assert d.huge_extents <= {0, 1, 2}  # runs of 32 pages collapsed as map() would, where it can
        res = d.reserve(MIB2)
        d.map(res, 0, d.alloc(32))
        v = d.view(res, torch.int64, (MIB2 // 8,))
        assert int(v.abs().sum()) == 0
        if 0 in d.huge_extents:
            assert vma(res.base, "smaps")[1]["ShmemPmdMapped"] == MIB2 // 1024
        d.unmap(res, 0, 32)
    with HostDriver(num_pages=4, page_size=PS) as d:
        assert not d.preallocated and os.fstat(d._fd).st_blocks == 0  # backed as pages are mapped


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/meminfo is Linux's")
def test_memory_info_reads_what_the_machine_has_available():
    available, total = memory_info()
    assert 0 < available <= total and total == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_a_preallocated_pool_larger_than_available_memory_is_refused_before_anything_is_backed(monkeypatch):
    """Populating more than the machine has does not fail: the OOM killer ends the process."""
    monkeypatch.setattr(host, "memory_info", lambda: (4 * PS, 1 << 30))  # a machine with 256 KiB free
    opened, memfd_create = [], os.memfd_create
    monkeypatch.setattr(host.os, "memfd_create", lambda *a: opened.append(a) or memfd_create(*a))
    with pytest.raises(
        HostMemoryError, match="pool needs 0.5 MiB and this machine has 0.2 MiB available"
    ) as e:
        HostDriver(num_pages=8, page_size=PS, populate=True, preallocate=True)
    assert isinstance(e.value, MemoryError) and (e.value.requested, e.value.available) == (8 * PS, 4 * PS)
    assert not opened  # refused before the pool's memfd exists
    with HostDriver(num_pages=8, page_size=PS) as d:  # on demand: nothing is backed at start
        assert os.fstat(d._fd).st_blocks == 0


def test_a_kernel_that_refuses_populate_advice_gets_its_pages_mapped_populated(monkeypatch):
    real = host._libc

    class OldKernel:  # the C library of a kernel before 5.14: no MADV_POPULATE_WRITE
        def __getattr__(self, name):
            return getattr(real, name)

        def madvise(self, addr, size, advice):
            if advice == host.MADV_POPULATE_WRITE:
                ctypes.set_errno(errno.EINVAL)
                return -1
            return real.madvise(addr, size, advice)

    monkeypatch.setattr(host, "_libc", OldKernel())
    with HostDriver(num_pages=32, page_size=PS, populate=True) as d:
        res = d.reserve(MIB2)
        d.map(res, 0, d.alloc(32))
        assert not d.huge_run  # nothing more is collapsed where populating fails
        assert vma(res.base, "smaps")[1]["Rss"] == MIB2 // 1024  # populated all the same
        v = d.view(res, torch.int64, (MIB2 // 8,))
        v[:] = 3
        assert int(v.sum()) == 3 * MIB2 // 8


@pytest.mark.skipif(huge_page_size() != MIB2, reason="the kernel has no 2 MiB transparent huge pages")
def test_a_run_of_small_pages_filling_an_aligned_huge_page_is_collapsed_into_one():
    with HostDriver(num_pages=64, page_size=PS, populate=True) as d:
        assert d.huge_run == MIB2
        res = d.reserve(2 * MIB2)
        assert res.base % MIB2 == 0
        pages = d.alloc(64)
        for first in range(0, 32, 8):  # as a slot grows: 512 KiB at a time
            d.map(res, first * PS, pages[first : first + 8])
            d.view(res, torch.int16, (8 * PS // 2,), offset=first * PS)[:] = first
        # pool pages 1..32 (not an aligned run of the memfd) in the second huge page: left alone
        d.unmap(res, 0, 32)
        d.map(res, MIB2, pages[1:33])
        if 0 not in d.huge_extents:
            pytest.skip("this kernel has no MADV_COLLAPSE, or no free 2 MiB of memory now")
        assert d.huge_extents == {0}
        assert vma(res.base + MIB2, "smaps")[1]["ShmemPmdMapped"] == 0
        d.unmap(res, MIB2, 32)
        d.map(res, 0, pages[:32])  # the collapsed run again: one huge page at once
        assert vma(res.base, "smaps")[1]["ShmemPmdMapped"] == MIB2 // 1024
        v = d.view(res, torch.int16, (MIB2 // 2,))
        assert all(int(v[first * PS // 2]) == first for first in range(0, 32, 8))  # data kept


@pytest.mark.skipif(huge_page_size() != MIB2, reason="the kernel has no 2 MiB transparent huge pages")
def test_a_tensor_on_huge_pages_starts_zeroed_populated_on_a_huge_page_boundary():
    fallbacks = vmstat("thp_fault_fallback")
    t = zeros_on_huge_pages((2, MIB2 // 2), torch.bfloat16)  # two huge pages
    assert t.shape == (2, MIB2 // 2) and t.dtype == torch.bfloat16 and not t.any()
    assert t.data_ptr() % MIB2 == 0
    assert "hg" in vm_flags(t.data_ptr())  # asked before the first touch
    _, fields = vma(t.data_ptr(), "smaps")
    assert fields["Rss"] == 2 * MIB2 // 1024  # populated: no step takes the first touch
    # "madvise" and "always" grant them to private memory, or the kernel counts a fallback when it
    # finds no free 2 MiB of memory; "never" leaves 4 KiB pages.
    if anon_huge_pages():
        assert fields["AnonHugePages"] == 2 * MIB2 // 1024 or vmstat("thp_fault_fallback") > fallbacks
    t[1] = 3
    assert float(t.float().sum()) == 3 * MIB2 // 2


def test_a_tensor_on_huge_pages_of_no_elements_is_plain_zeros():
    t = zeros_on_huge_pages((0, 4), torch.float32)
    assert t.shape == (0, 4) and t.dtype == torch.float32


@pytest.mark.parametrize("populate", [False, True])
def test_populate_prefaults_pages(populate):
    with HostDriver(num_pages=2, page_size=PS, populate=populate) as d:
        res = d.reserve(2 * PS)
        d.map(res, 0, d.alloc(2))
        # Fresh pages: resident in this mapping only when pre-faulted.
        rss = vma(res.base, "smaps")[1]["Rss"]
        assert rss == (2 * PS // 1024 if populate else 0)
        v = d.view(res, torch.int16, (PS,))
        v[:] = 3
        assert int(v.sum()) == 3 * PS
        assert vma(res.base, "smaps")[1]["Rss"] == 2 * PS // 1024


def test_punch_returns_memory_and_zeroes_the_page(driver):
    res = driver.reserve(PS)
    (p,) = driver.alloc(1)
    driver.map(res, 0, [p])
    page_view(driver, res, 0)[:] = 0x5A
    driver.unmap(res, 0)
    driver.free([p])  # without punch the content survives
    assert driver.alloc(1) == [p]
    driver.map(res, 0, [p])
    assert bool((page_view(driver, res, 0) == 0x5A).all())
    driver.unmap(res, 0)
    blocks = os.fstat(driver._fd).st_blocks
    driver.free([p], punch=True)
    assert blocks - os.fstat(driver._fd).st_blocks == PS // 512
    assert driver.stats.pages_punched == 1
    assert driver.alloc(1) == [p]
    driver.map(res, 0, [p])
    assert bool((page_view(driver, res, 0) == 0).all())


def test_preallocate_backs_the_whole_pool():
    with HostDriver(num_pages=4, page_size=PS, preallocate=True) as d:
        assert os.fstat(d._fd).st_blocks * 512 >= 4 * PS


# ------------------------------------------------------------------ model check
NUM_PAGES, SLOTS = 6, 5
OS_PAGE = mmap.PAGESIZE


class DriverModel(RuleBasedStateMachine):
    """Random alloc / map / alias / unmap / write / free against a plain Python model.

    The model knows which page every offset holds, each page's byte content (every page
    starts with its own byte, writes use fresh bytes, punched pages read zero), the free
    pool, map counts and every counter.
    """

    @initialize()
    def start(self) -> None:
        self.d = HostDriver(num_pages=NUM_PAGES, page_size=OS_PAGE)
        # Give every pool page its own byte first, so a page mapped from the wrong place shows.
        scratch = self.d.reserve(NUM_PAGES * OS_PAGE)
        pages = self.d.alloc(NUM_PAGES)
        self.d.map(scratch, 0, pages)
        for p in pages:
            self.d.view(scratch, torch.uint8, (OS_PAGE,), offset=p * OS_PAGE)[:] = p + 1
        self.d.release(scratch)
        self.d.free(pages)
        self.content = [p + 1 for p in range(NUM_PAGES)]
        self.next_byte = NUM_PAGES + 1
        self.res = [self.d.reserve(SLOTS * OS_PAGE) for _ in range(2)]
        self.views = [self.d.view(r, torch.uint8, (SLOTS, OS_PAGE)) for r in self.res]
        self.slots: list[dict[int, int]] = [{}, {}]
        self.allocated: set[int] = set()
        self.expect = {
            "map_calls": 1,
            "unmap_calls": 1,
            "pages_mapped": 0,
            "peak_pages_mapped": NUM_PAGES,
            "exhaustion_events": 0,
            "pages_punched": 0,
        }

    def teardown(self) -> None:
        if hasattr(self, "d"):
            self.d.close()

    def mapped_pages(self) -> list[int]:
        return [p for slots in self.slots for p in slots.values()]

    @rule(n=st.integers(0, 3))
    def alloc(self, n: int) -> None:
        free = NUM_PAGES - len(self.allocated)
        if n > free:
            with pytest.raises(PoolExhaustedError):
                self.d.alloc(n)
            self.expect["exhaustion_events"] += 1
            return
        pages = self.d.alloc(n)
        assert len(pages) == n and not self.allocated & set(pages)
        self.allocated |= set(pages)

    @rule(data=st.data(), r=st.integers(0, 1))
    def map(self, data, r: int) -> None:
        free_slots = [s for s in range(SLOTS) if s not in self.slots[r]]
        if not self.allocated or not free_slots:
            return
        first = data.draw(st.sampled_from(free_slots))
        room = next((s for s in range(first, SLOTS) if s in self.slots[r]), SLOTS) - first
        pages = data.draw(st.lists(st.sampled_from(sorted(self.allocated)), min_size=1, max_size=room))
        self.d.map(self.res[r], first * OS_PAGE, pages)
        self.expect["map_calls"] += 1 + sum(b != a + 1 for a, b in pairwise(pages))
        for i, p in enumerate(pages):
            self.slots[r][first + i] = p
        self.expect["pages_mapped"] += len(pages)
        self.expect["peak_pages_mapped"] = max(self.expect["peak_pages_mapped"], self.expect["pages_mapped"])

    @rule(data=st.data(), r=st.integers(0, 1))
    def unmap(self, data, r: int) -> None:
        if not self.slots[r]:
            return
        first = data.draw(st.sampled_from(sorted(self.slots[r])))
        length = next((s for s in range(first, SLOTS) if s not in self.slots[r]), SLOTS) - first
        n = data.draw(st.integers(1, length))
        got = self.d.unmap(self.res[r], first * OS_PAGE, n)
        assert got == [self.slots[r].pop(s) for s in range(first, first + n)]
        self.expect["unmap_calls"] += 1
        self.expect["pages_mapped"] -= n

    @rule(data=st.data(), r=st.integers(0, 1))
    def write(self, data, r: int) -> None:
        if not self.slots[r]:
            return
        slot = data.draw(st.sampled_from(sorted(self.slots[r])))
        self.views[r][slot] = self.next_byte
        self.content[self.slots[r][slot]] = self.next_byte
        self.next_byte = self.next_byte % 255 + 1

    @rule(data=st.data(), punch=st.booleans())
    def free(self, data, punch: bool) -> None:
        idle = sorted(self.allocated - set(self.mapped_pages()))
        if not idle:
            return
        pages = data.draw(st.lists(st.sampled_from(idle), min_size=1, unique=True))
        self.d.free(pages, punch=punch)
        self.allocated -= set(pages)
        if punch:
            self.expect["pages_punched"] += len(pages)
            for p in pages:
                self.content[p] = 0

    @rule(data=st.data(), r=st.integers(0, 1))
    def wrong_use(self, data, r: int) -> None:
        """Each refused call must leave everything as it was (the invariants check that)."""
        mapped, unmapped = sorted(self.slots[r]), [s for s in range(SLOTS) if s not in self.slots[r]]
        if mapped and self.allocated:
            with pytest.raises(AlreadyMappedError):
                self.d.map(self.res[r], data.draw(st.sampled_from(mapped)) * OS_PAGE, [min(self.allocated)])
        if unmapped:
            with pytest.raises(NotMappedError):
                self.d.unmap(self.res[r], data.draw(st.sampled_from(unmapped)) * OS_PAGE)
        if self.mapped_pages():
            with pytest.raises(PageStateError):
                self.d.free([data.draw(st.sampled_from(self.mapped_pages()))])
        free_pages = sorted(set(range(NUM_PAGES)) - self.allocated)
        if free_pages and unmapped:
            with pytest.raises(PageStateError):
                self.d.map(self.res[r], unmapped[0] * OS_PAGE, [free_pages[0]])

    @invariant()
    def matches_model(self) -> None:
        if not hasattr(self, "d"):
            return
        assert [r.mapped for r in self.res] == self.slots
        assert self.d.free_page_count == NUM_PAGES - len(self.allocated)
        counts = [self.mapped_pages().count(p) for p in range(NUM_PAGES)]
        assert [self.d.map_count(p) for p in range(NUM_PAGES)] == counts
        s = self.d.stats
        assert {k: getattr(s, k) for k in self.expect} == self.expect
        for r in range(2):
            for slot, page in self.slots[r].items():
                assert bool((self.views[r][slot] == self.content[page]).all()), (r, slot, page)


TestDriverModel = DriverModel.TestCase
TestDriverModel.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
