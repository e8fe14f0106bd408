"""Random draws over CPU logits in one pass per row: each row's softmax CDF inverted at one
uniform number, without materialising the probabilities.

The sampler's torch path writes softmax(logits) as a new [S, V] tensor, then inverts the CDF
(`sampler.inverse_cdf`). For 64 x 49,152 fp32 logits from memory on two cores of an AMX Xeon
the softmax took 4.2 ms (a 12.6 MB tensor allocated and written) and the draw 1.1 ms, against
0.8 ms to read the logits once. This kernel reads a row, sums its weights 2^((x - max) * scale)
in fp32 per CDF_BLOCK-token block (as inverse_cdf sums its blocks), runs a float64 sum over the
blocks to find the one holding u x total, and walks that block's weights again. Same
distribution as the torch path; a draw can differ from it where u x total falls within
rounding of a token's boundary. Built like the argmax kernel (`cc -O3 -march=native -fopenmp`,
cached per source and CPU).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from functools import cache

import torch

from vmkv.decode_kernel_source import VECTOR_EXP2
from vmkv.native_build import load_c_function

CDF_BLOCK = 256  # tokens per block of the two-level CDF (the sampler's inverse_cdf too)
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]
_PARALLEL_ELEMENTS = 1 << 17  # below this many logits a parallel region costs more than it saves
SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef __AVX512F__
#define V 16
#else
#define V 8
#endif
#define BLOCK CDF_BLOCK
typedef float vf __attribute__((vector_size(V * 4)));
typedef int32_t vi __attribute__((vector_size(V * 4)));
VECTOR_EXP2
/* 2^(d * scale), with d * scale taken as 0 where d == 0, so a scale of inf (a vanishing
   temperature) leaves the maxima a weight of 1 each and the rest 0. */
static inline vf exp2_scaled(vf d, float scale) {
    return exp2_v(select_v(d == splat(0.f), splat(0.f), d * scale));
}
static inline float exp2_scaled1(float d, float scale) { return d == 0.f ? 1.f : exp2f(d * scale); }

/* The largest of x[0, n) (n <= BLOCK) and mx; NaN if x holds one. */
static inline float block_max(const float* x, int64_t n, float mx) {
    vf m = splat(mx), v;
    vi nan = (vi){};
    int64_t i = 0;
    for (; i + V <= n; i += V) {
        memcpy(&v, x + i, sizeof v);
        nan |= (vi)(v != v);
        m = select_v(v > m, v, m);
    }
    for (int l = 0; l < V; l++) {
        if (nan[l]) return NAN;
        mx = m[l] > mx ? m[l] : mx;
    }
    for (; i < n; i++) {
        if (x[i] != x[i]) return NAN;
        mx = x[i] > mx ? x[i] : mx;
    }
    return mx;
}

/* Weights 2^((x - mx) * scale) of x[0, n) (n <= BLOCK), into w when w is not NULL; their fp32 sum. */
static inline float block_weights(const float* x, int64_t n, float mx, float scale, float* w) {
    vf s = splat(0.f), v;
    int64_t i = 0;
    for (; i + V <= n; i += V) {
        memcpy(&v, x + i, sizeof v);
        const vf e = exp2_scaled(v - mx, scale);
        if (w) memcpy(w + i, &e, sizeof e);
        s += e;
    }
    float sum = 0.f;
    for (int l = 0; l < V; l++) sum += s[l];
    for (; i < n; i++) {
        const float e = exp2_scaled1(x[i] - mx, scale);
        if (w) w[i] = e;
        sum += e;
    }
    return sum;
}

/* The token of row x[0, n) whose CDF first exceeds u x the total, or -1 where the row's maximum
   is not finite (NaN or +inf: the caller's torch path handles those). One pass over the row, in
   blocks: a block's sum is taken against the running maximum of the row so far (its base) and
   rescaled to the final maximum after, as online softmax does, so the row is read from memory
   once (with a separate max pass first: 1.42 against 1.28 ms for 64 x 49,152 logits from memory
   on two cores of an AMX Xeon). cdf, base: n / BLOCK + 1 each of scratch. Caps as inverse_cdf
   does: rounding can only push the target up to the total itself, so never past the last block,
   nor the last token, with mass. */
static int64_t draw_row(const float* x, int64_t n, float scale, double u, double* cdf, float* base) {
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
    float mx = -INFINITY;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t i0 = b * BLOCK, len = n - i0 < BLOCK ? n - i0 : BLOCK;
        mx = block_max(x + i0, len, mx);
        if (mx != mx || mx == INFINITY) return -1;
        /* -inf - -inf is NaN: blocks before the row's first finite logit weigh 0 */
        cdf[b] = mx == -INFINITY ? 0.0 : block_weights(x + i0, len, mx, scale, NULL);
        base[b] = mx;
    }
    if (!isfinite(mx)) return -1;
    double total = 0;
    for (int64_t b = 0; b < blocks; b++) {
        total += cdf[b] * (double)exp2_scaled1(base[b] - mx, scale);
        cdf[b] = total;
    }
    const double target = u * total;
    int64_t b = 0;
    while (b < blocks - 1 && !(cdf[b] > target) && cdf[b] < total) b++;
    const int64_t i0 = b * BLOCK, len = n - i0 < BLOCK ? n - i0 : BLOCK;
    float w[BLOCK];
    block_weights(x + i0, len, mx, scale, w);
    double run = b > 0 ? cdf[b - 1] : 0.0;
    int64_t last = 0;
    for (int64_t i = 0; i < len; i++) {
        if (w[i] > 0.f) last = i;
        run += w[i];
        if (run > target) return i0 + i;
    }
    return i0 + last;
}

void draw_rows(const float* x, int64_t rows, int64_t n, int64_t stride, const float* scale,
               const double* uniform, int64_t* out, int threads) {
    #pragma omp parallel num_threads(threads) if(threads > 1)
    {
        double* cdf = malloc(sizeof(double) * (size_t)(n / BLOCK + 1));
        float* base = malloc(sizeof(float) * (size_t)(n / BLOCK + 1));
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            out[r] = cdf && base ? draw_row(x + r * stride, n, scale[r], uniform[r], cdf, base) : -1;
        free(cdf);
        free(base);
    }
}
""".replace("CDF_BLOCK", str(CDF_BLOCK)).replace("VECTOR_EXP2\n", VECTOR_EXP2)


@cache
def _kernel() -> ctypes._CFuncPtr | None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    argtypes = [p, i64, i64, i64, p, p, p, ctypes.c_int]
    return load_c_function(
        "draw", SOURCE, _FLAGS, "CPU draw kernel unavailable, using torch", "draw_rows", None, argtypes
    )


def draw_tokens(
    logits: torch.Tensor, temperature: Sequence[float], uniform: torch.Tensor
) -> torch.Tensor | None:
    """Per row of fp32 [S, V] logits, the first token at which the CDF of softmax(logits / T)
    exceeds uniform[row] (float64 [S, 1], in [0, 1)), T = temperature[row] > 0. None where the
    kernel does not apply (not built here, not CPU fp32 rows with a contiguous last dimension, a
    row whose maximum is NaN or +inf): the caller then takes the torch path."""
    rows, width = logits.shape
    fits = logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(-1) == 1
    kernel = _kernel() if fits and rows > 0 and 0 < width < 2**31 else None
    if kernel is None:
        return None
    # log2(e) / T in float32; a temperature so small that this overflows gives inf (argmax rows)
    scale = torch.tensor([math.log2(math.e) / t for t in temperature], dtype=torch.float64).float()
    draws = uniform.to(torch.float64).contiguous()
    out = torch.empty(rows, dtype=torch.long)
    threads = torch.get_num_threads() if logits.numel() >= _PARALLEL_ELEMENTS else 1
    kernel(
        logits.data_ptr(),
        rows,
        width,
        logits.stride(0),
        scale.data_ptr(),
        draws.data_ptr(),
        out.data_ptr(),
        threads,
    )
    return None if bool((out < 0).any()) else out
