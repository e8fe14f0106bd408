"""CudaDriver's call sequence against a fake cuda.bindings.driver (no GPU needed).

The fake keeps the state the real driver would (per-thread current context, reservations,
live handles, mapped pages) and rejects what the real one rejects, so a test that
passes here issues calls a real GPU would accept in the same order.
"""

from __future__ import annotations

import ctypes
import enum
import gc
import subprocess
import sys
import threading
import types
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from vmkv.drivers import CudaDriver, DriverUnavailableError, InvalidOffsetError, RawCallError, dlpack
from vmkv.drivers import cuda as cuda_driver

G = 2 * 1024 * 1024  # the fake's allocation granularity


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_INVALID_CONTEXT = 201


class CUmemAllocationType(enum.IntEnum):
    CU_MEM_ALLOCATION_TYPE_PINNED = 1


class CUmemLocationType(enum.IntEnum):
    CU_MEM_LOCATION_TYPE_DEVICE = 1


class CUmemAccess_flags(enum.IntEnum):  # noqa: N801 - the binding's own name
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class CUmemAllocationGranularity_flags(enum.IntEnum):  # noqa: N801 - the binding's own name
    CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0


@dataclass
class CUmemLocation:
    type: Any = None
    id: int = 0


@dataclass
class CUmemAllocationProp:
    type: Any = None
    location: CUmemLocation = field(default_factory=CUmemLocation)


@dataclass
class CUmemAccessDesc:
    location: CUmemLocation = field(default_factory=CUmemLocation)
    flags: Any = None


@dataclass(frozen=True)
class Opaque:
    """Stands for CUdevice, CUcontext, CUdeviceptr and CUmemGenericAllocationHandle."""

    kind: str
    value: int

    def __int__(self) -> int:
        return self.value


@dataclass
class Call:
    name: str
    args: tuple
    thread: str


class FakeCudaDriver:
    """Records every call; `fail(name, code, nth)` makes the nth next call return code."""

    CUresult = CUresult
    CUmemAllocationType = CUmemAllocationType
    CUmemLocationType = CUmemLocationType
    CUmemAccess_flags = CUmemAccess_flags
    CUmemAllocationGranularity_flags = CUmemAllocationGranularity_flags
    CUmemLocation = CUmemLocation
    CUmemAllocationProp = CUmemAllocationProp
    CUmemAccessDesc = CUmemAccessDesc

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.ctx = Opaque("ctx", 0xC0)
        self.retains = 0
        self.reserved: dict[int, int] = {}
        self.created: list[Opaque] = []
        self.live_handles: set[Opaque] = set()
        self.handle_size: dict[Opaque, int] = {}
        self.mapped_ranges: dict[int, tuple[Opaque, int]] = {}  # start -> (handle, size)
        self.in_flight = 0  # kernels "launched" by a test and not yet synchronized
        self.hazards: list[tuple[int, int]] = []  # unmaps issued while a kernel was in flight
        self._next_base = 0x7F00_0000_0000
        self._next_handle = 1
        self._failures: dict[str, tuple[CUresult, int]] = {}
        self._tls = threading.local()

    # ------------------------------------------------------------ test controls
    def fail(self, name: str, code: CUresult, nth: int = 1) -> None:
        self._failures[name] = (code, nth)

    def launch(self) -> None:
        """Stand for an asynchronous kernel queued on the device; cuCtxSynchronize retires it."""
        self.in_flight += 1

    def current(self) -> Opaque:
        stack = getattr(self._tls, "stack", None)
        return stack[-1] if stack else Opaque("ctx", 0)

    def set_current(self, ctx: Opaque) -> None:
        self._tls.stack = [ctx]

    def names(self, skip: tuple[str, ...] = ("cuCtxGetCurrent", "cuGetErrorName")) -> list[str]:
        return [c.name for c in self.calls if c.name not in skip]

    def args_of(self, name: str) -> list[tuple]:
        return [c.args for c in self.calls if c.name == name]

    def _enter(self, name: str, *args: Any, needs_ctx: bool = True) -> CUresult:
        self.calls.append(Call(name, args, threading.current_thread().name))
        if name in self._failures:
            code, nth = self._failures[name]
            if nth == 1:
                del self._failures[name]
                return code
            self._failures[name] = (code, nth - 1)
        if needs_ctx and int(self.current()) != int(self.ctx):
            return CUresult.CUDA_ERROR_INVALID_CONTEXT
        return CUresult.CUDA_SUCCESS

    # ---------------------------------------------------------------- the API
    def cuInit(self, flags: int):
        return (self._enter("cuInit", flags, needs_ctx=False),)

    def cuDeviceGet(self, ordinal: int):
        return self._enter("cuDeviceGet", ordinal, needs_ctx=False), Opaque("dev", ordinal)

    def cuDevicePrimaryCtxRetain(self, dev: Opaque):
        err = self._enter("cuDevicePrimaryCtxRetain", dev, needs_ctx=False)
        self.retains += err == CUresult.CUDA_SUCCESS
        return err, self.ctx

    def cuDevicePrimaryCtxRelease(self, dev: Opaque):
        err = self._enter("cuDevicePrimaryCtxRelease", dev, needs_ctx=False)
        self.retains -= err == CUresult.CUDA_SUCCESS
        return (err,)

    def cuCtxGetCurrent(self):
        return self._enter("cuCtxGetCurrent", needs_ctx=False), self.current()

    def cuCtxSetCurrent(self, ctx: Opaque):
        err = self._enter("cuCtxSetCurrent", ctx, needs_ctx=False)
        if err == CUresult.CUDA_SUCCESS:
            self.set_current(ctx)
        return (err,)

    def cuCtxPushCurrent(self, ctx: Opaque):
        err = self._enter("cuCtxPushCurrent", ctx, needs_ctx=False)
        if err == CUresult.CUDA_SUCCESS:
            self._tls.stack = [*getattr(self._tls, "stack", []), ctx]
        return (err,)

    def cuCtxPopCurrent(self):
        err = self._enter("cuCtxPopCurrent", needs_ctx=False)
        return err, (self._tls.stack.pop() if err == CUresult.CUDA_SUCCESS else None)

    def cuGetErrorName(self, code: CUresult):
        return self._enter("cuGetErrorName", code, needs_ctx=False), CUresult(code).name.encode()

    def cuMemGetAllocationGranularity(self, prop: CUmemAllocationProp, option: Any):
        return self._enter("cuMemGetAllocationGranularity", prop, option), G

    def cuCtxSynchronize(self):
        err = self._enter("cuCtxSynchronize")
        if err == CUresult.CUDA_SUCCESS:
            self.in_flight = 0
        return (err,)

    def cuMemCreate(self, size: int, prop: CUmemAllocationProp, flags: int):
        err = self._enter("cuMemCreate", size, prop, flags)
        if err != CUresult.CUDA_SUCCESS:
            return err, None
        if size <= 0 or size % G:  # the real driver wants whole granules
            return CUresult.CUDA_ERROR_INVALID_VALUE, None
        handle = Opaque("handle", self._next_handle)
        self._next_handle += 1
        self.created.append(handle)
        self.live_handles.add(handle)
        self.handle_size[handle] = size
        return err, handle

    def cuMemRelease(self, handle: Opaque):
        err = self._enter("cuMemRelease", handle)
        if err == CUresult.CUDA_SUCCESS:
            if handle not in self.live_handles:
                return (CUresult.CUDA_ERROR_INVALID_VALUE,)
            self.live_handles.remove(handle)
        return (err,)

    def cuMemAddressReserve(self, size: int, alignment: int, addr: int, flags: int):
        err = self._enter("cuMemAddressReserve", size, alignment, addr, flags)
        if err != CUresult.CUDA_SUCCESS:
            return err, None
        if size <= 0 or size % G:
            return CUresult.CUDA_ERROR_INVALID_VALUE, None
        base = self._next_base
        self._next_base += size + G
        self.reserved[base] = size
        return err, Opaque("ptr", base)

    def _mappings_in(self, ptr: int, size: int) -> list[int]:
        """Starts of the mappings that overlap [ptr, ptr + size)."""
        return [p for p, (_, n) in self.mapped_ranges.items() if p < ptr + size and ptr < p + n]

    def cuMemAddressFree(self, ptr: int, size: int):
        err = self._enter("cuMemAddressFree", ptr, size)
        if err != CUresult.CUDA_SUCCESS:
            return (err,)
        if self.reserved.get(ptr) != size or self._mappings_in(ptr, size):  # still mapped: refused
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        del self.reserved[ptr]
        return (err,)

    def _in_reservation(self, ptr: int, size: int) -> bool:
        return (
            ptr % G == 0
            and size % G == 0
            and any(b <= ptr and ptr + size <= b + s for b, s in self.reserved.items())
        )

    def cuMemMap(self, ptr: int, size: int, offset: int, handle: Opaque, flags: int):
        err = self._enter("cuMemMap", ptr, size, offset, handle, flags)
        if err != CUresult.CUDA_SUCCESS:
            return (err,)
        if (
            not self._in_reservation(ptr, size)
            or handle not in self.live_handles
            or offset != 0
            or size != self.handle_size[handle]
            or self._mappings_in(ptr, size)
        ):
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        self.mapped_ranges[ptr] = (handle, size)
        return (err,)

    def cuMemSetAccess(self, ptr: int, size: int, descs: list, count: int):
        err = self._enter("cuMemSetAccess", ptr, size, descs, count)
        if err != CUresult.CUDA_SUCCESS:
            return (err,)
        covered = sum(self.mapped_ranges[p][1] for p in self._mappings_in(ptr, size))
        starts_inside = all(ptr <= p for p in self._mappings_in(ptr, size))
        if covered != size or not starts_inside or count != len(descs):  # every byte must be mapped
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        return (err,)

    def cuMemUnmap(self, ptr: int, size: int):
        err = self._enter("cuMemUnmap", ptr, size)
        if err != CUresult.CUDA_SUCCESS:
            return (err,)
        inside = self._mappings_in(ptr, size)
        whole = inside and all(ptr <= p and p + self.mapped_ranges[p][1] <= ptr + size for p in inside)
        if not whole:  # the real driver cannot unmap part of one mapping
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        if self.in_flight:  # the real driver would pull the pages from under a running kernel
            self.hazards.append((ptr, size))
        for p in inside:
            del self.mapped_ranges[p]
        return (err,)

    @property
    def mapped(self) -> dict[int, Opaque]:
        return {p: handle for p, (handle, _) in self.mapped_ranges.items()}


def install_fake(monkeypatch: pytest.MonkeyPatch, fake_torch: bool = True) -> FakeCudaDriver:
    """Install a fake as cuda.bindings.driver and, if asked, stand in for torch's CUDA start-up."""
    drv = FakeCudaDriver()
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = drv
    package = types.ModuleType("cuda")
    package.bindings = bindings
    monkeypatch.setitem(sys.modules, "cuda", package)
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", drv)
    if fake_torch:
        monkeypatch.setattr(
            cuda_driver, "_init_torch_cuda", lambda index: drv.calls.append(Call("torch_init", (index,), ""))
        )
    return drv


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeCudaDriver:
    return install_fake(monkeypatch)


def test_construct_inits_torch_then_shares_primary_context_and_creates_pool(fake):
    drv = CudaDriver(3, device=1)
    assert fake.names() == [
        "torch_init",
        "cuInit",
        "cuDeviceGet",
        "cuDevicePrimaryCtxRetain",
        "cuCtxSetCurrent",
        "cuMemGetAllocationGranularity",
        "cuMemCreate",
        "cuMemCreate",
        "cuMemCreate",
    ]
    assert fake.args_of("torch_init") == [(1,)]
    assert fake.args_of("cuDeviceGet") == [(1,)]
    assert fake.args_of("cuCtxSetCurrent") == [(fake.ctx,)]
    prop, option = fake.args_of("cuMemGetAllocationGranularity")[0]
    assert option == CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    for size, prop, flags in fake.args_of("cuMemCreate"):
        assert (size, flags) == (G, 0)
        assert prop.type == CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        assert (prop.location.type, prop.location.id) == (CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE, 1)
    assert drv.page_size == G and drv.device == torch.device("cuda", 1)
    assert drv.merges_runs is False
    assert len(fake.live_handles) == 3 and fake.retains == 1


def test_page_size_multiple_of_granularity(fake):
    drv = CudaDriver(2, page_size=2 * G)
    assert [a[0] for a in fake.args_of("cuMemCreate")] == [2 * G, 2 * G]
    drv.close()
    fake.calls.clear()
    with pytest.raises(ValueError, match="granularity"):
        CudaDriver(2, page_size=G + 4096)
    assert "cuMemCreate" not in fake.names()
    assert fake.retains == 0  # the context retain of the failed constructor was given back
    with pytest.raises(ValueError, match="granularity"):
        CudaDriver(2, page_size=0)
    with pytest.raises(TypeError, match="page_size"):
        CudaDriver(2, page_size=float(G))
    with pytest.raises(TypeError, match="device"):
        CudaDriver(2, device="cuda:0")
    assert "cuMemCreate" not in fake.names() and fake.retains == 0


def test_reserve_map_unmap_release_calls(fake):
    drv = CudaDriver(4)
    handles = fake.created
    fake.calls.clear()

    res = drv.reserve(3 * G - 5)
    assert fake.names() == ["cuMemAddressReserve"]
    assert fake.args_of("cuMemAddressReserve") == [(3 * G, 0, 0, 0)]
    assert res.base in fake.reserved and res.size == 3 * G

    drv.alloc(3)
    fake.calls.clear()
    drv.map(res, G, [2, 0])
    assert fake.names() == ["cuMemMap", "cuMemSetAccess", "cuMemMap", "cuMemSetAccess"]
    assert fake.args_of("cuMemMap") == [
        (res.base + G, G, 0, handles[2], 0),
        (res.base + 2 * G, G, 0, handles[0], 0),
    ]
    for _ptr, size, descs, count in fake.args_of("cuMemSetAccess"):
        assert size == G and count == 1 and len(descs) == 1
        assert descs[0].location.type == CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        assert descs[0].location.id == 0
        assert descs[0].flags == CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    assert [a[0] for a in fake.args_of("cuMemSetAccess")] == [res.base + G, res.base + 2 * G]
    assert fake.mapped == {res.base + G: handles[2], res.base + 2 * G: handles[0]}
    assert drv.stats.map_calls == 2 and drv.stats.pages_mapped == 2

    fake.calls.clear()
    assert drv.unmap(res, G, 2) == [2, 0]
    assert fake.names() == ["cuCtxSynchronize", "cuMemUnmap", "cuMemUnmap"]
    assert fake.args_of("cuMemUnmap") == [(res.base + G, G), (res.base + 2 * G, G)]
    assert fake.mapped == {} and drv.stats.unmap_calls == 2

    drv.map(res, 0, [1])
    fake.calls.clear()
    drv.release(res)
    assert fake.names() == ["cuCtxSynchronize", "cuMemUnmap", "cuMemAddressFree"]
    assert fake.args_of("cuMemAddressFree") == [(res.base, 3 * G)]
    assert fake.reserved == {} and fake.mapped == {}


def test_close_unmaps_frees_and_releases_every_handle(fake):
    drv = CudaDriver(3)
    handles = fake.created
    res = drv.reserve(2 * G)
    drv.map(res, G, drv.alloc(1))
    fake.calls.clear()
    drv.close()
    assert fake.names() == [
        "cuCtxSynchronize",
        "cuMemUnmap",
        "cuMemAddressFree",
        "cuMemRelease",
        "cuMemRelease",
        "cuMemRelease",
        "cuDevicePrimaryCtxRelease",
    ]
    assert fake.args_of("cuMemUnmap") == [(res.base + G, G)]
    assert fake.args_of("cuMemAddressFree") == [(res.base, 2 * G)]
    assert [a[0] for a in fake.args_of("cuMemRelease")] == handles
    assert not fake.live_handles and not fake.reserved and not fake.mapped and fake.retains == 0
    fake.calls.clear()
    drv.close()
    assert fake.calls == []


def test_close_releases_all_handles_even_if_one_fails(fake):
    drv = CudaDriver(3)
    fake.fail("cuMemRelease", CUresult.CUDA_ERROR_INVALID_VALUE, nth=2)
    with pytest.raises(RawCallError, match="cuMemRelease failed: CUDA_ERROR_INVALID_VALUE"):
        drv.close()
    assert len(fake.args_of("cuMemRelease")) == 3 and fake.retains == 0
    fake.calls.clear()
    drv.close()  # a retried close gives back nothing a second time
    assert drv.closed
    assert "cuMemRelease" not in fake.names() and "cuDevicePrimaryCtxRelease" not in fake.names()


def test_misaligned_offset_is_rejected_before_any_call(fake):
    drv = CudaDriver(2)
    res = drv.reserve(2 * G)
    pages = drv.alloc(1)
    fake.calls.clear()
    with pytest.raises(InvalidOffsetError):
        drv.map(res, G // 2, pages)
    with pytest.raises(InvalidOffsetError):
        drv.map(res, 2 * G, pages)
    assert "cuMemMap" not in fake.names() and res.mapped == {}


def test_failing_map_raises_and_counts_nothing(fake):
    drv = CudaDriver(2)
    res = drv.reserve(G)
    pages = drv.alloc(1)
    fake.fail("cuMemMap", CUresult.CUDA_ERROR_OUT_OF_MEMORY)
    with pytest.raises(RawCallError, match="cuMemMap failed: CUDA_ERROR_OUT_OF_MEMORY"):
        drv.map(res, 0, pages)
    assert res.mapped == {} and drv.map_count(pages[0]) == 0
    assert drv.stats.pages_mapped == 0 and drv.stats.map_calls == 0
    drv.map(res, 0, pages)  # the same map goes through once the driver accepts it
    assert res.mapped == {0: pages[0]}


def test_failing_set_access_unmaps_the_page_it_mapped(fake):
    drv = CudaDriver(2)
    res = drv.reserve(G)
    pages = drv.alloc(1)
    fake.fail("cuMemSetAccess", CUresult.CUDA_ERROR_INVALID_VALUE)
    with pytest.raises(RawCallError, match="cuMemSetAccess"):
        drv.map(res, 0, pages)
    assert fake.mapped == {} and res.mapped == {} and drv.stats.pages_mapped == 0
    assert fake.args_of("cuMemUnmap") == [(res.base, G)]


def test_failing_create_midway_releases_created_handles(fake):
    fake.fail("cuMemCreate", CUresult.CUDA_ERROR_OUT_OF_MEMORY, nth=3)
    with pytest.raises(RawCallError, match="cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY"):
        CudaDriver(5)
    assert len(fake.args_of("cuMemCreate")) == 3
    assert len(fake.args_of("cuMemRelease")) == 2
    assert not fake.live_handles and fake.retains == 0


def test_background_thread_makes_context_current_once(fake):
    drv = CudaDriver(2)
    res = drv.reserve(2 * G)
    pages = drv.alloc(2)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            drv.map(res, 0, pages[:1])
            drv.map(res, G, pages[1:])
        except BaseException as e:  # surfaced in the main thread below
            errors.append(e)

    fake.calls.clear()
    thread = threading.Thread(target=worker, name="mapper")
    thread.start()
    thread.join()
    assert errors == []
    on_thread = [c.name for c in fake.calls if c.thread == "mapper" and c.name != "cuCtxGetCurrent"]
    assert on_thread == ["cuCtxSetCurrent", "cuMemMap", "cuMemSetAccess", "cuMemMap", "cuMemSetAccess"]
    assert fake.mapped == {res.base: fake.created[pages[0]], res.base + G: fake.created[pages[1]]}


def test_thread_bound_to_another_context_gets_it_back(fake):
    drv = CudaDriver(1)
    res = drv.reserve(G)
    pages = drv.alloc(1)
    other = Opaque("ctx", 0xD0)
    seen: list[Opaque] = []

    def worker() -> None:
        fake.set_current(other)
        drv.map(res, 0, pages)
        seen.append(fake.current())

    fake.calls.clear()
    thread = threading.Thread(target=worker, name="other")
    thread.start()
    thread.join()
    assert fake.names() == ["cuCtxPushCurrent", "cuMemMap", "cuMemSetAccess", "cuCtxPopCurrent"]
    assert seen == [other] and res.mapped == {0: pages[0]}


def _capsule_fields(capsule: object) -> tuple[int, int, int, int, int]:
    """(data, device_type, device_id, ndim, shape[0]) of a "dltensor" capsule, read with ctypes."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    t = ctypes.cast(get(capsule, b"dltensor"), ctypes.POINTER(dlpack.DLManagedTensor)).contents.dl_tensor
    return t.data, t.device.device_type, t.device.device_id, t.ndim, t.shape[0]


def test_view_before_any_map_names_the_device_and_queries_no_pointer(fake, monkeypatch):
    """A cache makes its views at construction, before any page is mapped: the capsule must say
    CUDA and the ordinal itself, so torch never asks the runtime about the unmapped pointer."""
    drv = CudaDriver(2, device=1)
    res = drv.reserve(2 * G)
    seen: list[tuple[int, int, int, int, int]] = []

    def from_dlpack(capsule: object) -> torch.Tensor:  # a CPU torch cannot make CUDA tensors
        seen.append(_capsule_fields(capsule))
        return torch.zeros(seen[-1][4], dtype=torch.uint8)

    monkeypatch.setattr(torch.utils.dlpack, "from_dlpack", from_dlpack)
    fake.calls.clear()
    t = drv.view(res, torch.float16, (4, 8), offset=G + 128)
    assert seen == [(res.base + G + 128, dlpack.KDL_CUDA, 1, 1, 64)]
    assert fake.names() == [] and fake.mapped == {}  # nothing mapped, nothing asked of the driver
    assert t.shape == (4, 8) and t.dtype == torch.float16


def test_dlpack_view_is_zero_copy_through_the_real_conversion():
    """The same capsule code on host memory, through torch's real from_dlpack: writes through
    the view land in the buffer, and the capsule is let go when the tensor dies."""
    before = dlpack.live_capsules()
    buf = torch.zeros(256, dtype=torch.uint8)
    view = dlpack.byte_tensor(buf.data_ptr() + 64, 128, torch.device("cpu"))
    assert dlpack.live_capsules() == before + 1
    view.view(torch.float32)[:] = 2.5
    assert torch.all(buf[64:192].view(torch.float32) == 2.5) and torch.all(buf[:64] == 0)
    del view
    gc.collect()
    assert dlpack.live_capsules() == before
    with pytest.raises(ValueError, match="device"):
        dlpack.byte_tensor(buf.data_ptr(), 8, torch.device("meta"))


def test_unmap_waits_for_queued_kernels_first(fake):
    """cuMemUnmap does not wait for kernels reading the range: every unmap path synchronizes."""
    drv = CudaDriver(3)
    res = drv.reserve(3 * G)
    drv.map(res, 0, drv.alloc(3))
    fake.launch()
    drv.unmap(res, 0)
    fake.launch()
    drv.release(res)  # unmaps the rest
    assert fake.hazards == []
    names = fake.names()
    assert names.count("cuCtxSynchronize") == 2
    assert names.index("cuCtxSynchronize") < names.index("cuMemUnmap")


def test_fake_refuses_what_the_real_driver_refuses(fake):
    """The fake is as strict as the driver, so the call sequences above are ones a GPU accepts."""
    drv = CudaDriver(2)
    res = drv.reserve(2 * G)
    pages = drv.alloc(2)
    drv.map(res, 0, pages)
    raw, h = fake, fake.created
    assert raw.cuMemUnmap(res.base, G // 2)[0] == CUresult.CUDA_ERROR_INVALID_VALUE  # part of a mapping
    assert raw.cuMemSetAccess(res.base, 3 * G, [None], 1)[0] == CUresult.CUDA_ERROR_INVALID_VALUE
    assert raw.cuMemCreate(G + 4096, CUmemAllocationProp(), 0)[0] == CUresult.CUDA_ERROR_INVALID_VALUE
    assert raw.cuMemAddressFree(res.base, 2 * G)[0] == CUresult.CUDA_ERROR_INVALID_VALUE  # still mapped
    assert raw.cuMemMap(res.base, G, 0, h[1], 0)[0] == CUresult.CUDA_ERROR_INVALID_VALUE  # over a mapping
    fake.launch()
    assert raw.cuMemUnmap(res.base, G)[0] == CUresult.CUDA_SUCCESS
    assert fake.hazards == [(res.base, G)]  # an unmap under a running kernel is recorded


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU and cuda-python")
def test_real_gpu_view_before_map_then_write_read_and_unmap_after_kernel():
    pytest.importorskip("cuda.bindings")
    with CudaDriver(2) as drv:
        page = drv.page_size
        res = drv.reserve(2 * page)
        view = drv.view(res, torch.float32, (2 * page // 4,))  # before any page is mapped
        drv.map(res, 0, drv.alloc(2))
        view.fill_(1.5)
        total = view.sum()  # queued; unmap must wait for it
        drv.unmap(res, 0, 2)
        assert float(total) == 1.5 * (2 * page // 4)


def test_allocation_granularity_without_keeping_a_pool(fake):
    assert cuda_driver.allocation_granularity(1) == G
    assert fake.args_of("cuDeviceGet") == [(1,)]
    assert not fake.live_handles and fake.retains == 0  # the probe's page and context given back


def test_punch_keeps_the_handle(fake):
    drv = CudaDriver(1)
    pages = drv.alloc(1)
    fake.calls.clear()
    drv.free(pages, punch=True)
    assert fake.names() == [] and len(fake.live_handles) == 1
    assert drv.alloc(1) == pages


def test_cuinit_raising_without_libcuda_is_unavailable(fake, monkeypatch):
    def no_library(flags: int):
        raise RuntimeError('"cuda" is an NVIDIA driver library and can only be found via system search')

    monkeypatch.setattr(fake, "cuInit", no_library)
    with pytest.raises(DriverUnavailableError, match="cuInit"):
        CudaDriver(1)


def test_cuinit_error_code_is_unavailable(fake):
    fake.fail("cuInit", CUresult.CUDA_ERROR_INVALID_VALUE)
    with pytest.raises(DriverUnavailableError, match="CUDA_ERROR_INVALID_VALUE"):
        CudaDriver(1)
    assert "cuDevicePrimaryCtxRetain" not in fake.names()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_torch_without_cuda_is_unavailable(monkeypatch):
    fake = install_fake(monkeypatch, fake_torch=False)
    with pytest.raises(DriverUnavailableError, match="torch"):
        CudaDriver(1)
    assert fake.calls == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_real_driver_is_unavailable_here_and_package_imports_without_cuda_python():
    with pytest.raises(DriverUnavailableError):
        CudaDriver(1)
    code = "import sys, vmkv.drivers; assert 'cuda.bindings' not in sys.modules; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
