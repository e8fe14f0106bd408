"""A bf16 matrix-vector kernel for decode steps of a few rows, on CPUs with AVX512-BF16.

At one to a few rows a linear layer is a pass over its weight, so its speed is the memory
bandwidth it reaches. oneDNN (prepacked) read a [1536, 576] bf16 weight at 12 GB/s on one
core of an AVX512-BF16 EPYC whose plain sum reads 18 GB/s. This kernel streams the
original row-major weight once, one row at a time: `vdpbf16ps` on the raw bf16 values into
fp32 sums, the bias added in fp32, one round-to-nearest-even to bf16, so it computes what
a bf16 GEMM computes, summed in another order (0.07% of outputs one bf16 step apart from
torch's in a [1536, 576] test). Rows of the output are split over torch's threads.

Built with the system C compiler (~0.5 s) on first use into `$XDG_CACHE_HOME/vmkv/kernels`
under a hash of the source and flags; without a compiler `load_gemv` warns and returns None
and callers keep oneDNN.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

MAX_ROWS = 4  # more rows than this reuse a weight enough for oneDNN's blocked GEMM to win
_FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp", "-fPIC", "-shared")
SOURCE = r"""
#include <stdint.h>
#include <immintrin.h>

#define BLOCK 16 /* output columns per work item: one masked 16-lane bf16 store */

static inline __m512 dot(const uint16_t *x, const uint16_t *w, int64_t k_len) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= k_len; k += 64) {
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(x + k), (__m512bh)_mm512_loadu_si512(w + k));
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(x + k + 32),
                              (__m512bh)_mm512_loadu_si512(w + k + 32));
    }
    if (k < k_len) /* k_len is a multiple of 32 */
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(x + k), (__m512bh)_mm512_loadu_si512(w + k));
    return _mm512_add_ps(a0, a1);
}

/* y[m, n] = bias[n] + sum_k x[m, k] * w[n, k] for m < rows; w row-major [n_len, k_len]. */
int gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t rows,
              int64_t n_len, int64_t k_len, int64_t x_stride, int64_t y_stride, int threads) {
    if (k_len % 32) return 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n0 = 0; n0 < n_len; n0 += BLOCK) {
        int64_t width = n_len - n0 < BLOCK ? n_len - n0 : BLOCK;
        __mmask16 mask = (__mmask16)((1u << width) - 1);
        __m512 b = _mm512_setzero_ps();
        if (bias)
            b = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + n0)), 16));
        for (int64_t m = 0; m < rows; m++) { /* later rows find this block of w in cache */
            float sums[BLOCK] = {0};
            for (int64_t j = 0; j < width; j++)
                sums[j] = _mm512_reduce_add_ps(dot(x + m * x_stride, w + (n0 + j) * k_len, k_len));
            __m512 v = _mm512_add_ps(_mm512_loadu_ps(sums), b);
            _mm256_mask_storeu_epi16(y + m * y_stride + n0, mask, (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
    return 0;
}
"""


class Gemv:
    """y = x @ weight.T (+ bias) for bf16 x [rows <= MAX_ROWS, K] (last dim contiguous), weight [N, K]."""

    def __init__(self, function: ctypes._CFuncPtr, library: ctypes.CDLL) -> None:
        self.function = function
        self.library = library  # kept alive as long as the function is

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows, k_len = x.shape
        out = torch.empty(rows, weight.shape[0], dtype=torch.bfloat16)
        status = self.function(
            x.data_ptr(),
            weight.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            rows,
            weight.shape[0],
            k_len,
            x.stride(0),
            out.stride(0),
            torch.get_num_threads(),
        )
        if status:
            raise ValueError(f"the bf16 GEMV needs K to be a multiple of 32, got {k_len}")
        return out


def can_run(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes this call: few bf16 rows on the CPU, K a multiple of 32."""
    return (
        x.dim() == 2
        and x.shape[0] <= MAX_ROWS
        and x.dtype == weight.dtype == torch.bfloat16
        and weight.shape[1] % 32 == 0
        and x.stride(1) == 1
        and weight.is_contiguous()
        and x.device.type == "cpu"
    )


def load_gemv() -> Gemv | None:
    """The kernel, built on first use; None (with a warning saying why) where it cannot be."""
    if not torch.cpu._is_avx512_bf16_supported():
        return None
    try:
        library = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr.strip() if isinstance(e, subprocess.CalledProcessError) else str(e)
        log.warning("bf16 GEMV kernel unavailable, decode linears use oneDNN: %s", detail)
        return None
    function = library.gemv_bf16
    function.restype = ctypes.c_int
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    function.argtypes = [p, p, p, p, i64, i64, i64, i64, i64, ctypes.c_int]
    return Gemv(function, library)


def _build() -> Path:
    """Compile the source, or reuse an earlier build of the same source and flags."""
    key = "\n".join([SOURCE, " ".join(_FLAGS)])
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vmkv" / "kernels"
    target = root / f"gemv_{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    if target.exists():
        return target
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise FileNotFoundError("no C compiler found (install one or set CC)")
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        src, built = Path(tmp) / "gemv.c", Path(tmp) / target.name
        src.write_text(SOURCE)
        subprocess.run(
            [compiler, *_FLAGS, "-o", str(built), str(src)], check=True, capture_output=True, text=True
        )
        os.replace(built, target)  # atomic: concurrent builders leave one complete file
    return target
