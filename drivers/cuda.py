"""CudaDriver: GPU virtual memory through the CUDA driver's VMM API (cuda-python).

The pool is num_pages physical handles from cuMemCreate, made up front so mapping never
allocates; a reservation is cuMemAddressReserve; mapping is cuMemMap + cuMemSetAccess,
one page per call, because cuMemUnmap cannot unmap part of one mapping. Every call runs
in the device's primary context, the one PyTorch uses, so views are ordinary CUDA tensors.

Stream ordering: cuMemMap and cuMemSetAccess take effect when they return, so a kernel
launched after a map (on any stream, from any thread) sees the pages. cuMemUnmap does not
wait for kernels already queued that read the range, so every unmap first synchronizes the
context (cuCtxSynchronize: all streams, PyTorch's included), as PyTorch's own
expandable-segments allocator does before it unmaps. Views are DLPack tensors that name
their device, so torch never queries a pointer that is still unmapped (dlpack.py).

cuda-python is imported only when a driver is built: this module imports on any machine.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .base import MemoryDriver, Reservation, as_int
from .dlpack import byte_tensor
from .errors import DriverUnavailableError, RawCallError


def _load_bindings() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise DriverUnavailableError(f"CudaDriver needs cuda-python (pip install 'vmkv[cuda]'): {e}") from e
    return driver


def _init_torch_cuda(index: int) -> None:
    """Make PyTorch create the device's primary context first, so the driver shares it."""
    if not torch.cuda.is_available():
        raise DriverUnavailableError("CudaDriver needs a GPU visible to a CUDA build of torch; none found")
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise ValueError(f"device must be a CUDA ordinal in [0, {count}), got {index}")
    torch.empty(1, device=f"cuda:{index}")


def allocation_granularity(device: int = 0) -> int:
    """The smallest page a CudaDriver can map on `device` (the VMM minimum granularity, 2 MiB on
    current GPUs), for layouts that size pages and budgets before they build a driver. Asked of
    a one-page driver, so it takes the same context and error handling as every other call."""
    with CudaDriver(1, device=device) as probe:
        return probe.granularity


class CudaDriver(MemoryDriver):
    """Physical pages from pre-created cuMemCreate handles, mapped into reserved GPU ranges.

    page_size: defaults to the allocation granularity (2 MiB on current GPUs) and must be
        a multiple of it.
    device: the CUDA ordinal whose memory backs the pool and whose primary context is used.

    free(punch=True) keeps the page: a pool page is a handle that owns its memory, so
    releasing and recreating it would take the same memory back at once. The pool size is
    the GPU memory budget, fixed at construction.

    Any thread may call in: each raw call first makes the primary context current on the
    calling thread (set once on a thread that has none, pushed and popped around the
    call on a thread bound to another context, so that thread's CUDA state is unchanged).
    """

    merges_runs = False

    def __init__(
        self, num_pages: int, page_size: int | None = None, device: int = 0, debug: bool = False
    ) -> None:
        device = as_int(device, "device")
        page_size = None if page_size is None else as_int(page_size, "page_size")
        self._drv = _load_bindings()
        _init_torch_cuda(device)
        self.device = torch.device("cuda", device)
        self._handles: list[Any] = []
        try:
            result = self._drv.cuInit(0)
        except Exception as e:  # without libcuda the bindings raise instead of returning a code
            raise DriverUnavailableError(f"cuInit failed, no usable CUDA driver library: {e}") from e
        if result[0] != self._drv.CUresult.CUDA_SUCCESS:
            raise DriverUnavailableError(f"cuInit failed: {self._error_name(result[0])}")
        self._cu_device = self._call("cuDeviceGet", device)
        self._ctx = self._call("cuDevicePrimaryCtxRetain", self._cu_device)
        self._ctx_retained = True
        try:
            with self._context():
                granularity = self._call(
                    "cuMemGetAllocationGranularity",
                    self._alloc_prop(),
                    self._drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                )
                self.granularity = int(granularity)
                page_size = granularity if page_size is None else page_size
                if page_size <= 0 or page_size % granularity:
                    raise ValueError(
                        f"page_size must be a positive multiple of the CUDA allocation "
                        f"granularity {granularity}, got {page_size}"
                    )
                super().__init__(page_size, num_pages, debug)
                self._create_pool()
        except BaseException:
            self._drv.cuDevicePrimaryCtxRelease(self._cu_device)
            raise

    # ------------------------------------------------------------ driver calls
    def _call(self, name: str, *args: Any) -> Any:
        """Run a driver call; a non-success CUresult becomes RawCallError naming both."""
        result = getattr(self._drv, name)(*args)
        if result[0] != self._drv.CUresult.CUDA_SUCCESS:
            raise RawCallError(f"{name} failed: {self._error_name(result[0])}")
        return result[1] if len(result) == 2 else None

    def _error_name(self, code: Any) -> str:
        err, name = self._drv.cuGetErrorName(code)
        if err == self._drv.CUresult.CUDA_SUCCESS and name:
            return name.decode() if isinstance(name, bytes) else str(name)
        return f"CUresult {int(code)}"

    @contextmanager
    def _context(self) -> Iterator[None]:
        current = int(self._call("cuCtxGetCurrent"))
        if current == int(self._ctx):
            yield
        elif current == 0:
            self._call("cuCtxSetCurrent", self._ctx)
            yield
        else:
            self._call("cuCtxPushCurrent", self._ctx)
            try:
                yield
            finally:
                self._call("cuCtxPopCurrent")

    def _location(self) -> Any:
        loc = self._drv.CUmemLocation()
        loc.type = self._drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        loc.id = self.device.index
        return loc

    def _alloc_prop(self) -> Any:
        prop = self._drv.CUmemAllocationProp()
        prop.type = self._drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location = self._location()
        return prop

    def _create_pool(self) -> None:
        prop = self._alloc_prop()
        try:
            for _ in range(self.num_pages):
                self._handles.append(self._call("cuMemCreate", self.page_size, prop, 0))
        except BaseException:
            for handle in self._handles:
                self._drv.cuMemRelease(handle)
            self._handles = []
            raise

    # --------------------------------------------------------------- raw hooks
    def _raw_reserve(self, size: int) -> int:
        with self._context():
            return int(self._call("cuMemAddressReserve", size, 0, 0, 0))

    def _raw_release(self, base: int, size: int) -> None:
        with self._context():
            self._call("cuMemAddressFree", base, size)

    def _raw_map(self, addr: int, first_page: int, num_pages: int) -> None:
        access = self._drv.CUmemAccessDesc()
        access.location = self._location()
        access.flags = self._drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        with self._context():
            for i in range(num_pages):  # one page per call: merges_runs is False
                page_addr = addr + i * self.page_size
                self._call("cuMemMap", page_addr, self.page_size, 0, self._handles[first_page + i], 0)
                try:
                    self._call("cuMemSetAccess", page_addr, self.page_size, [access], 1)
                except RawCallError:
                    self._drv.cuMemUnmap(page_addr, self.page_size)  # leave nothing half-mapped
                    raise

    def _unmap_run(self, res: Reservation, first: int, num_pages: int) -> None:
        """Wait for every queued kernel once, then unmap: an unmap under a running kernel
        that reads the range is an illegal address, and cuMemUnmap does not wait."""
        with self._context():
            self._call("cuCtxSynchronize")
        super()._unmap_run(res, first, num_pages)

    def _raw_unmap(self, addr: int, num_pages: int) -> None:
        with self._context():
            for i in range(num_pages):
                self._call("cuMemUnmap", addr + i * self.page_size, self.page_size)

    def _raw_view(self, addr: int, nbytes: int) -> torch.Tensor:
        return byte_tensor(addr, nbytes, self.device)

    def _raw_close(self) -> None:
        """Release every handle and the context retain; report the first failure after all.

        Each is given up before its call, so a close() retried after a failure releases nothing twice.
        """
        handles, self._handles = self._handles, []
        retained, self._ctx_retained = self._ctx_retained, False
        errors: list[RawCallError] = []
        with self._context():
            for handle in handles:
                try:
                    self._call("cuMemRelease", handle)
                except RawCallError as e:
                    errors.append(e)
        if retained:
            try:
                self._call("cuDevicePrimaryCtxRelease", self._cu_device)
            except RawCallError as e:
                errors.append(e)
        if errors:
            raise errors[0]
