"""Give the C heap's free memory back to the OS once the engine goes idle.

After an overload the engine's resident memory stayed up: glibc keeps the memory freed by
torch's CPU tensors (step activations, logits, a long prefill's buffers) in its arenas for
reuse, and the tops of those arenas are only returned on their own terms. `malloc_trim(0)`
returns every free page of every arena; called once each time the last request finishes, it
costs a few milliseconds while nothing waits on the engine. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache


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
