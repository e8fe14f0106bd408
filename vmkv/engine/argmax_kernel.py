"""Greedy decoding's argmax over CPU logits: one vectorised pass per row, rows over threads.

torch's `max(dim=-1)` (values and indices) is not vectorised on the CPU: for the default
model's [64, 49152] fp32 logits it took 1.7-3.3 ms on two cores of an AVX2 EPYC, while a
pass that only reads them takes ~0.3 ms (`amax`, which has no indices). This kernel keeps
per lane the first maximum seen and its index, so one pass gives what torch's `max(dim=-1)`
gives: the index of the first maximum, a NaN counting as the maximum. Built like the decode
kernel (`cc -O3 -march=native -fopenmp`, cached per source and CPU); where it cannot be,
`first_max_indices` uses torch.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from vmkv.native_build import load_c_function

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]
# Below this many logits a row-parallel region costs more than it saves (one row: ~50k).
_PARALLEL_ELEMENTS = 1 << 17
SOURCE = r"""
#include <stdint.h>
#include <string.h>

typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));

/* Index of the first maximum of x[0, n) (n >= 1, n < 2^31); the first NaN if there is one. */
static int64_t first_max(const float* x, int64_t n) {
    int64_t i = 0, best_i = 0;
    float best = x[0];
    if (n >= 16) {
        /* lane l: the largest of x[l], x[l + 8], ... seen so far, and where it first was */
        vf m, v;
        memcpy(&m, x, sizeof m);
        vi at = {0, 1, 2, 3, 4, 5, 6, 7}, idx = at, nan = (vi)(m != m);
        for (i = 8; i + 8 <= n; i += 8) {
            memcpy(&v, x + i, sizeof v);
            at += 8;
            const vi gt = (vi)(v > m);
            nan |= (vi)(v != v);
            m = (vf)(((vi)v & gt) | ((vi)m & ~gt));
            idx = (at & gt) | (idx & ~gt);
        }
        int any_nan = 0;
        for (int l = 0; l < 8; l++) any_nan |= nan[l];
        if (any_nan) {
            i = 1;  /* rare: the scalar loop below finds the first NaN */
        } else {
            best = m[0];
            best_i = idx[0];
            for (int l = 1; l < 8; l++)
                if (m[l] > best || (m[l] == best && idx[l] < best_i)) { best = m[l]; best_i = idx[l]; }
        }
    } else {
        i = 1;
    }
    for (; i < n && best == best; i++)  /* the tail, in order; stops at a NaN */
        if (x[i] > best || x[i] != x[i]) { best = x[i]; best_i = i; }
    return best_i;
}

void first_max_rows(const float* x, int64_t rows, int64_t n, int64_t stride, int64_t* out, int threads) {
    #pragma omp parallel for num_threads(threads) if(threads > 1)
    for (int64_t r = 0; r < rows; r++) out[r] = first_max(x + r * stride, n);
}
"""


@cache
def _kernel() -> ctypes._CFuncPtr | None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    unavailable = "CPU argmax kernel unavailable, using torch"
    return load_c_function(
        "argmax", SOURCE, _FLAGS, unavailable, "first_max_rows", None, [p, i64, i64, i64, p, ctypes.c_int]
    )


def first_max_indices(logits: torch.Tensor) -> torch.Tensor:
    """`logits.max(dim=-1).indices` for [S, V] logits: each row's first maximum, a NaN counting
    as the maximum. fp32 CPU rows with a contiguous last dimension take the kernel."""
    rows, width = logits.shape
    fits = logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(-1) == 1
    kernel = _kernel() if fits and rows > 0 and 0 < width < 2**31 else None
    if kernel is None:
        return logits.max(dim=-1).indices
    out = torch.empty(rows, dtype=torch.long)
    threads = torch.get_num_threads() if logits.numel() >= _PARALLEL_ELEMENTS else 1
    kernel(logits.data_ptr(), rows, width, logits.stride(0), out.data_ptr(), threads)
    return out
