"""Physical-memory drivers: reserve virtual ranges, map pool pages into them, view them as tensors."""

from .base import DriverStats, MemoryDriver, Reservation
from .cuda import CudaDriver
from .errors import (
    AlreadyMappedError,
    DriverClosedError,
    DriverError,
    DriverUnavailableError,
    HostMemoryError,
    InvalidOffsetError,
    NotMappedError,
    PageStateError,
    PoolExhaustedError,
    RawCallError,
)
from .host import (
    DEFAULT_PAGE_SIZE,
    HostDriver,
    anon_huge_pages,
    huge_page_size,
    memory_info,
    require_available,
    shmem_huge_pages,
    zeros_on_huge_pages,
)

__all__ = [
    "DEFAULT_PAGE_SIZE",
    "AlreadyMappedError",
    "CudaDriver",
    "DriverClosedError",
    "DriverError",
    "DriverStats",
    "DriverUnavailableError",
    "HostDriver",
    "HostMemoryError",
    "InvalidOffsetError",
    "MemoryDriver",
    "NotMappedError",
    "PageStateError",
    "PoolExhaustedError",
    "RawCallError",
    "Reservation",
    "anon_huge_pages",
    "huge_page_size",
    "memory_info",
    "require_available",
    "shmem_huge_pages",
    "zeros_on_huge_pages",
]
