"""Give the C heap's free memory back to the OS: when the engine goes idle, and now and then while
it is busy.

After an overload the engine's resident memory stayed up: glibc keeps the memory freed by
torch's CPU tensors (step activations, logits, a long prefill's buffers) in its arenas for
reuse, and the tops of those arenas are only returned on their own terms. `malloc_trim(0)`
returns every free page of every arena. Called only when the last request finished, it never
ran under a steady load: in the served soak (SmolLM2, paged) the main arena ([heap] in smaps)
held 19 MiB more after a burst of 64 than before it, with its free bytes up from 34 to 61 MiB,
while the other arenas and the mmapped chunks did not move; one `malloc_trim(0)` gave 15 MiB of
it back at once. So a busy engine trims too, at most once every `BUSY_TRIM_SECONDS`.
Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from functools import cache

# SmolLM2 fp32, paged, one thread, steady load with a burst: a trim took 0.95 ms (median of 36,
# 3.7 ms at most) and the step after it 1.8 ms longer than the one before (its buffers fault back
# in); every 10 s that is ~0.03% of the engine's time.
BUSY_TRIM_SECONDS = 10.0


@cache
def _malloc_trim() -> ctypes._CFuncPtr | None:
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def trim_heap() -> bool:
    """Return the heap's free pages to the OS; whether anything was returned (False off glibc)."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


class HeapTrimmer:
    """Trims the heap when the engine empties, and after a step at most once every
    BUSY_TRIM_SECONDS, so what an overload freed goes back while requests keep arriving."""

    def __init__(self) -> None:
        self.interval = BUSY_TRIM_SECONDS
        self._last = time.monotonic()

    def trim(self) -> None:
        trim_heap()
        self._last = time.monotonic()

    def trim_if_due(self) -> None:
        if time.monotonic() - self._last >= self.interval:
            self.trim()
