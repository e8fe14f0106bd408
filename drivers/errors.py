"""Precise exceptions for wrong use of a memory driver; none of them leaves state half-changed."""


class DriverError(Exception):
    """Base class of every driver error."""


class DriverUnavailableError(DriverError):
    """The driver cannot run here (no GPU, no cuda-python, not Linux)."""


class DriverClosedError(DriverError):
    """The driver was used after close()."""


class InvalidOffsetError(DriverError, ValueError):
    """An offset or size is outside a reservation or not page-aligned."""


class AlreadyMappedError(DriverError):
    """Mapping over an offset that is already mapped."""


class NotMappedError(DriverError):
    """Unmapping, or viewing in debug mode, an offset that is not mapped."""


class PageStateError(DriverError):
    """A pool page is used in a state that does not allow it (not allocated, still mapped)."""


class PoolExhaustedError(DriverError, MemoryError):
    """Fewer free physical pages than requested. Carries the numbers for the scheduler."""

    def __init__(self, requested: int, free: int, total: int) -> None:
        super().__init__(f"physical page pool exhausted: requested {requested}, {free} of {total} free")
        self.requested = requested
        self.free = free
        self.total = total


class HostMemoryError(DriverError, MemoryError):
    """Memory to be backed now is more than the machine has available. Raised before any of it
    is touched: populating it would only get the process killed by the kernel's OOM killer."""

    def __init__(self, what: str, requested: int, available: int) -> None:
        super().__init__(
            f"{what} needs {requested / 2**20:,.1f} MiB and this machine has {available / 2**20:,.1f} "
            "MiB available: give the KV cache a smaller budget"
        )
        self.requested = requested
        self.available = available


class RawCallError(DriverError, OSError):
    """The OS or CUDA driver rejected a call the bookkeeping considered valid."""
