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

Between trims the heap should keep a step's buffers for the next step: see MMAP_THRESHOLD.
Elsewhere than glibc none of this does anything.
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
# Blocks up to this size come from the heap, so the next step reuses a step's buffers. Above
# glibc's own threshold (128 KiB, raised only as mmapped blocks are freed) each was a fresh
# mapping, its pages zeroed and faulted in on first touch and unmapped on free: a batch-64 step
# sampling at temperature 1 (SmolLM2, [64, 49,152] fp32 logits, probabilities and their sums)
# took ~7,000 minor faults and 13 ms of system time per step that way, 5 faults and 0.2-0.8 ms
# with these settings (paged, compiled, two cores).
MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit
TRIM_THRESHOLD = 256 << 20  # free memory at the heap's top kept for reuse; the trims return it
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)


@cache
def _libc(name: str, *argtypes: type) -> ctypes._CFuncPtr | None:
    """A glibc function returning int, or None elsewhere."""
    path = ctypes.util.find_library("c")
    function = getattr(ctypes.CDLL(path), name, None) if path else None
    if function is not None:
        function.argtypes, function.restype = list(argtypes), ctypes.c_int
    return function


def trim_heap() -> bool:
    """Return the heap's free pages to the OS; whether anything was returned (False off glibc)."""
    trim = _libc("malloc_trim", ctypes.c_size_t)
    return bool(trim(0)) if trim is not None else False


def keep_step_buffers() -> bool:
    """Have the heap serve and keep blocks up to MMAP_THRESHOLD for reuse (process-wide); whether
    glibc took the settings."""
    mallopt = _libc("mallopt", ctypes.c_int, ctypes.c_int)
    return (
        mallopt is not None
        and bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
        and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    )


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
