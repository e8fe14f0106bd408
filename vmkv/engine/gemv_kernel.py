"""`vmkv::packed_linear`, a half-precision CPU linear as one C++ torch operator, with a bf16
matrix-vector kernel for decode steps of a few rows and a bf16 GEMM on weights in pairs (and
`vmkv::packed_logits`, the same values as fp32, for the vocabulary projection, and
`vmkv::packed_gated_linear`, an MLP's stacked gate/up linear with its SiLU-and-multiply written
by the GEMM on pairs: gated_fusion.py).

At one to a few rows a linear layer is a pass over its weight, so its speed is the memory
bandwidth it reaches. The kernel streams the original row-major bf16 weight once, one row at
a time, into fp32 sums, adds the bias in fp32 and rounds once to bf16, so it computes what a
bf16 GEMM computes, summed in another order. Output columns are split over torch's threads.
More rows go to a GEMM on `packed`, the weight prepared at load (cpu_linear.py); on a CPU with
AMX tiles, up to TILE_MAX_ROWS rows first go to a tile GEMM that reads the original weight in
place (y^T = W x^T, x laid out in pairs per call), which streams the weights nearer the memory's
rate than oneDNN does at decode batch sizes (gemm_tiles in the source). Where `packed`
is the weight in pairs (4-D, `in_pairs`: bf16 on AVX512-BF16 CPUs), this file's GEMM reads it:
every row count on `vdpbf16ps` without AMX (gemm_pairs in the source), the rows past the tile
GEMM's on the tile unit with AMX (gemm_pairs_tiles). Two builds:

- AVX512-BF16: `vdpbf16ps` on the raw bf16 values (and AMX tiles where the CPU has them);
  `packed` is the weight in pairs, or oneDNN's layout of an fp16 weight.
  oneDNN (prepacked) read a [1536, 576] bf16 weight at 12 GB/s on one core of an AVX512-BF16
  EPYC whose plain sum reads 18 GB/s; the kernel's outputs were within one bf16 step of
  torch's (0.07% of them apart in a [1536, 576] test).
- AVX2 with FMA, for CPUs without native bf16: the weights are widened to fp32 in registers,
  so a decode step reads 2 bytes per weight; `packed` is oneDNN's layout of the weight in
  fp32, for fp32 GEMMs of the same values. On a 2-core AVX2 EPYC the fp32 GEMM for one row
  (MKL) read its weights at 5.9 GB/s where a plain fp32 sum over two threads reads 13 GB/s: a
  batch-1 step of the default model spent ~100 ms in its linears and vocabulary projection.

Why C++ and not a Python function: a decode step of the default model makes 210 linear
calls. Through a Python `torch.library.custom_op` each cost ~20 µs beyond the kernel
(~4 ms of a ~21 ms step); registered in C++ the dispatcher reaches the kernel in ~3 µs,
eager or compiled (inductor calls the operator from its generated code).

Built with the system C++ compiler against torch's headers (~10 s) on first use and cached
per source, flags and torch version (vmkv/native_build.py).
Where it cannot be built or the CPU has neither instruction set, `register()` defines the
same operator in Python over the GEMM alone, so callers never see the difference.
"""

from __future__ import annotations

import logging
import subprocess
from functools import cache
from pathlib import Path

import torch

from vmkv.native_build import build_failure, build_torch_library

log = logging.getLogger(__name__)

# Rows of x up to which the GEMV runs, per CPU kind; more reuse each weight enough for the GEMM
# to win. Timed over the default model's 30 layers of decode weights and vocabulary projection:
# - AVX512-BF16 with AMX (Xeon): oneDNN's GEMM runs on AMX tiles and is level at 11.4-13.1 ms
#   from 1 to 16 rows; the GEMV took 11.0 ms at 4 rows, 11.6 at 6 and 12.2 at 8.
# - AVX512-BF16 without AMX (a 2-core Zen 4 EPYC): oneDNN took 12.7-17.2 ms at 4-10 rows and
#   the GEMV 8.7-12.2; at 12 rows 14.4-16.0 against 16.5-18.0, at 13 about level (16.4-16.8
#   against 17.4), at 14 slower (18.7-19.1 against 18.0-18.4).
# - AVX2 keeps its earlier limit of 4, not measured again since.
MAX_ROWS = {"avx512_bf16_amx": 6, "avx512_bf16": 12, "avx2": 4}
# Rows up to which the tile GEMM (AMX builds) runs after the GEMV, before the GEMM on weights in
# pairs (on the tile unit too, there). Against oneDNN's GEMM it was the faster from 7 to 32 rows
# (the default model's 30 layers and vocabulary projection from memory, benchmarks/bench_gemm.py,
# a 2-core AMX Xeon: 14.3-14.9 ms at 16 rows against 19.2-21.4); against the GEMM on pairs, in
# compiled vattention decode steps at 300 tokens of context (one engine per process, three
# alternated rounds, medians), it is the faster at 8 and 16 sequences (23 against 25 ms, 27.5
# against 29) and the slower from 20 (20, 24, 28 and 32 sequences: 0.94x, 0.96x, 0.90x and 0.92x
# the time with pairs from 17 rows).
TILE_MAX_ROWS = 16


def _row_limit(isa: str) -> int:
    """MAX_ROWS for a build on this CPU: whether oneDNN has AMX tiles moves the AVX512 limit."""
    return MAX_ROWS[f"{isa}_amx" if isa == "avx512_bf16" and torch.cpu._is_amx_tile_supported() else isa]


SCHEMA = "packed_linear(Tensor x, Tensor weight, Tensor packed, Tensor? bias) -> Tensor"
LOGITS_SCHEMA = "packed_logits(Tensor x, Tensor weight, Tensor packed, Tensor? bias) -> Tensor"  # fp32 out
# silu(gate) * up of a [gate; up] weight's output halves (cpu_linear.py's gate/up groups)
GATED_SCHEMA = "packed_gated_linear(Tensor x, Tensor weight, Tensor packed, Tensor? bias) -> Tensor"
_FLAGS = ("-O3", "-std=c++17", "-fopenmp", "-fPIC", "-shared")
# the GEMV's instructions: vdpbf16ps on bf16 pairs, or AVX2 FMAs on weights widened in registers
_ISA_FLAGS = {
    "avx512_bf16": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"),
    "avx2": ("-mavx2", "-mfma"),
}
SOURCE = r"""
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <string.h>
#include <torch/library.h>

#include <algorithm>
#include <memory>
#include <vector>

namespace {

/* A decode step reads each weight once, so the kernel is a stream from memory, and two cores'
   hardware prefetchers alone kept too few lines in flight. Asking for the line this many bytes
   ahead into L2 (the same stream: rows are contiguous) read the default model's 30 layers and
   vocabulary projection at 24.9 against 18.4 GB/s (AVX512-BF16 build; the AVX2 build 21.2
   against 15.0), about a plain fp32 sum's rate, on a 2-core AMX Xeon; into L1, or 2 KiB ahead,
   gained about half as much. Batch-1 decode went from 18.5 to 15.2 ms a token at 300 tokens.
   On a 2-core Zen 4 EPYC one row took 8.1-9.7 ms against 10.1-10.3 without the prefetch, and
   2 or 8 KiB ahead, or into L1, were no faster than this. */
constexpr int64_t PREFETCH_BYTES = 4096;

inline void prefetch_ahead(const uint16_t *p) {
    _mm_prefetch(reinterpret_cast<const char *>(p) + PREFETCH_BYTES, _MM_HINT_T1);
}

constexpr int64_t MAX_ROWS = GEMV_MAX_ROWS; /* defined at build: _row_limit() */

#if defined(__AVX512BF16__)
constexpr int64_t K_MULTIPLE = 32;
constexpr int64_t BLOCK = 16; /* output columns per work item: one masked 16-lane bf16 store */

/* sums[r][j] = sum_k x[r, k] * w[j, k] for r < R, j < width: each weight vector is loaded
   once for R rows, and two accumulators per row keep two dot-product chains in flight. */
template <int R>
inline void block_dots(const uint16_t *x, int64_t x_stride, const uint16_t *w, int64_t k_len, int64_t width,
                       float sums[][BLOCK]) {
    for (int64_t j = 0; j < width; j++) {
        const uint16_t *row = w + j * k_len;
        __m512 a[R], b[R];
        for (int r = 0; r < R; r++) a[r] = b[r] = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k + 64 <= k_len; k += 64) {
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(row + k);
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(row + k + 32);
            prefetch_ahead(row + k);
            prefetch_ahead(row + k + 32);
            for (int r = 0; r < R; r++) {
                a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_loadu_si512(x + r * x_stride + k), w0);
                b[r] = _mm512_dpbf16_ps(b[r], (__m512bh)_mm512_loadu_si512(x + r * x_stride + k + 32), w1);
            }
        }
        if (k < k_len) { /* k_len is a multiple of 32 */
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(row + k);
            for (int r = 0; r < R; r++)
                a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_loadu_si512(x + r * x_stride + k), w0);
        }
        for (int r = 0; r < R; r++) sums[r][j] = _mm512_reduce_add_ps(_mm512_add_ps(a[r], b[r]));
    }
}

/* block_dots for rows <= R, the row count a compile-time constant. */
template <int R>
inline void block_dots_upto(int64_t rows, const uint16_t *x, int64_t x_stride, const uint16_t *w,
                            int64_t k_len, int64_t width, float sums[][BLOCK]) {
    if constexpr (R > 1)
        if (rows < R) return block_dots_upto<R - 1>(rows, x, x_stride, w, k_len, width, sums);
    block_dots<R>(x, x_stride, w, k_len, width, sums);
}

/* The GEMM on weights in pairs (the "pairs" packing, cpu_linear.py): w as [ceil(n / PANEL)]
   [k / 2][PANEL][2], so a panel of PANEL output columns is one stream and each 32-bit word holds
   two consecutive k of one column. One vdpbf16ps multiplies a column pair vector by a broadcast
   pair of x and adds both products into 16 fp32 sums, with no horizontal sums at the end. A
   register block is PANEL_ROWS rows x 2 vectors (24 accumulators of 32); a thread takes whole
   panels, so a panel's weights come from memory once per call and from L1/L2 for the other
   row blocks. */
constexpr int64_t PANEL = 32;
constexpr int PANEL_ROWS = 12;

/* Rows [0, R) of x against two 16-column halves of pairs (lo, hi; a panel's are panel and
   panel + 32): acc[r][j] = sum_k x[r, k] * w[column of half j, k] (fp32). */
template <int R>
inline void panel_block(const uint16_t *x, int64_t x_stride, const uint16_t *lo, const uint16_t *hi,
                        int64_t pairs, __m512 acc[][2]) {
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(lo + p * 2 * PANEL);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(hi + p * 2 * PANEL);
        for (int r = 0; r < R; r++) {
            int32_t pair;
            memcpy(&pair, x + r * x_stride + 2 * p, sizeof pair);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xb);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xb);
        }
    }
}

template <int R>
inline void panel_block_upto(int rows, const uint16_t *x, int64_t x_stride, const uint16_t *lo,
                             const uint16_t *hi, int64_t pairs, __m512 acc[][2]) {
    if constexpr (R > 1)
        if (rows < R) return panel_block_upto<R - 1>(rows, x, x_stride, lo, hi, pairs, acc);
    panel_block<R>(x, x_stride, lo, hi, pairs, acc);
}

/* 16 bf16 values as fp32 (a bf16 is the high half of its fp32). */
inline __m512 widen_bf16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 16 sums plus bias, rounded once to bf16, stored at y[at, at + 16) under mask: as bf16, or as
   those values in fp32 */
inline void store_sums(void *y, bool fp32_out, int64_t at, __mmask16 mask, __m512 sums, __m512 bias) {
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(sums, bias));
    if (fp32_out)
        _mm512_mask_storeu_ps(static_cast<float *>(y) + at, mask, widen_bf16(h));
    else
        _mm256_mask_storeu_epi16(static_cast<uint16_t *>(y) + at, mask, h);
}

/* A panel's two 16-column halves from column n0: which columns exist (mask) and their bias (add). */
inline void panel_columns(const uint16_t *bias, int64_t n0, int64_t n_len, __mmask16 mask[2], __m512 add[2]) {
    for (int j = 0; j < 2; j++) {
        const int64_t c0 = n0 + 16 * j, left = n_len - c0;
        const int64_t width = left < 0 ? 0 : (left < 16 ? left : 16);
        mask[j] = (__mmask16)((1u << width) - 1);
        add[j] = _mm512_setzero_ps();
        if (bias) add[j] = widen_bf16(_mm256_maskz_loadu_epi16(mask[j], bias + c0));
    }
}

/* e^x in 16 lanes, within ~1 ulp: 2^n e^r, n = round(x log2(e)), |r| <= ln(2) / 2 (Cephes' expf
   polynomial); 0 below -104 and infinity above 89, as expf gives. */
inline __m512 exp_ps(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    const __m512 e = _mm512_scalef_ps(p, n);
    const __mmask16 low = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-104.f), _CMP_LT_OQ);
    const __mmask16 high = _mm512_cmp_ps_mask(x, _mm512_set1_ps(89.f), _CMP_GT_OQ);
    return _mm512_mask_blend_ps(high, _mm512_mask_blend_ps(low, e, _mm512_setzero_ps()),
                                _mm512_set1_ps(__builtin_inff()));
}

inline __m512 round_bf16(__m512 v) { return widen_bf16((__m256i)_mm512_cvtneps_pbh(v)); }

/* silu(g) * u from fp32 sums, rounded to bf16 where the model's ops round: g and u (the linear's
   outputs), silu(g) = g / (1 + e^-g) (inductor's form of it), and the product. */
inline __m256i silu_times(__m512 g, __m512 u) {
    g = round_bf16(g);
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 s = round_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
    return (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(s, round_bf16(u)));
}

/* out [rows, half] = silu_times of y [rows, 2 * half]'s halves (y contiguous bf16). */
void gated_halves(const uint16_t *y, uint16_t *out, int64_t rows, int64_t half) {
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
        for (int64_t m = begin; m < end; m++)
            for (int64_t c = 0; c < half; c += 16) {
                const __mmask16 mask = (__mmask16)((1u << std::min<int64_t>(half - c, 16)) - 1);
                const uint16_t *g = y + m * 2 * half + c;
                const __m512 gv = widen_bf16(_mm256_maskz_loadu_epi16(mask, g));
                const __m512 uv = widen_bf16(_mm256_maskz_loadu_epi16(mask, g + half));
                _mm256_mask_storeu_epi16(out + m * half + c, mask, silu_times(gv, uv));
            }
    });
}

/* Where a block's two 16-column halves of pairs come from (word streams whose k pairs are
   2 * PANEL words apart, as in a panel) and what its sums become: one panel of y's columns, or
   for a gated linear the gate and the up columns of y's 16 columns from n0 (silu(gate) * up).
   mask and add: the halves' columns that exist, and their bias. */
struct BlockColumns {
    const uint16_t *b_lo, *b_hi;
    int64_t n0;
    __mmask16 mask[2];
    __m512 add[2];
};

/* The columns of block `unit` of w in pairs: panel `unit`, or for a gated linear (w = [gate; up],
   n_len = its output's width, a multiple of 16) the half panels holding gate and up columns
   16 * unit on. */
inline BlockColumns block_columns(const uint16_t *w, const uint16_t *bias, int64_t unit, int64_t n_len,
                                  int64_t k_len, bool gated) {
    BlockColumns c;
    if (!gated) {
        c.n0 = unit * PANEL;
        c.b_lo = w + unit * k_len * PANEL;
        c.b_hi = c.b_lo + 32;
        panel_columns(bias, c.n0, n_len, c.mask, c.add);
        return c;
    }
    c.n0 = 16 * unit;
    const int64_t column[2] = {c.n0, n_len + c.n0}; /* of gate, of up */
    const uint16_t *half_panel[2];
    for (int j = 0; j < 2; j++) {
        half_panel[j] = w + column[j] / PANEL * k_len * PANEL + column[j] % PANEL * 2;
        c.mask[j] = 0xffff;
        c.add[j] = bias ? widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(bias + column[j])))
                        : _mm512_setzero_ps();
    }
    c.b_lo = half_panel[0], c.b_hi = half_panel[1];
    return c;
}

/* How many block_columns units y's n_len columns take. */
inline int64_t column_blocks(int64_t n_len, bool gated) {
    return gated ? n_len / 16 : (n_len + PANEL - 1) / PANEL;
}

/* A gated block row: silu(gate) * up of its two halves' sums (bias added), 16 bf16 at y[at]. */
inline void store_gated(void *y, int64_t at, __m512 gate, __m512 up) {
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(static_cast<uint16_t *>(y) + at), silu_times(gate, up));
}

/* y = x @ w.T + bias, rounded once to bf16; stored as bf16, or as those values in fp32 (logits).
   x [rows, k] with row stride x_stride, k even; w in pairs for n columns. gated: w is [gate; up]
   and y [rows, n_len] gets silu(gate) * up (silu_times; n_len a multiple of 16, bf16 out). */
void gemm_pairs(const uint16_t *x, const uint16_t *w, const uint16_t *bias, void *y, bool fp32_out,
                int64_t rows, int64_t n_len, int64_t k_len, int64_t x_stride, bool gated) {
    const int64_t pairs = k_len / 2, units = column_blocks(n_len, gated);
    at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; b++) {
            const BlockColumns c = block_columns(w, bias, b, n_len, k_len, gated);
            for (int64_t r0 = 0; r0 < rows; r0 += PANEL_ROWS) {
                const int block = rows - r0 < PANEL_ROWS ? (int)(rows - r0) : PANEL_ROWS;
                __m512 acc[PANEL_ROWS][2];
                panel_block_upto<PANEL_ROWS>(block, x + r0 * x_stride, x_stride, c.b_lo, c.b_hi, pairs, acc);
                for (int r = 0; r < block; r++) {
                    const int64_t at = (r0 + r) * n_len + c.n0;
                    if (gated) {
                        const __m512 gate = _mm512_add_ps(acc[r][0], c.add[0]);
                        store_gated(y, at, gate, _mm512_add_ps(acc[r][1], c.add[1]));
                        continue;
                    }
                    for (int j = 0; j < 2; j++)
                        store_sums(y, fp32_out, at + 16 * j, c.mask[j], acc[r][j], c.add[j]);
                }
            }
        }
    });
}

/* y[m, n] = bias[n] + sum_k x[m, k] * w[n, k] for m < rows <= MAX_ROWS; w row-major [n_len, k_len]. */
void gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t rows,
               int64_t n_len, int64_t k_len, int64_t x_stride) {
    at::parallel_for(0, (n_len + BLOCK - 1) / BLOCK, 1, [&](int64_t begin, int64_t end) {
        for (int64_t block = begin; block < end; block++) {
            const int64_t n0 = block * BLOCK;
            const int64_t width = n_len - n0 < BLOCK ? n_len - n0 : BLOCK;
            const __mmask16 mask = (__mmask16)((1u << width) - 1);
            const uint16_t *wb = w + n0 * k_len;
            float sums[MAX_ROWS][BLOCK] = {};
            block_dots_upto<MAX_ROWS>(rows, x, x_stride, wb, k_len, width, sums);
            __m512 b = _mm512_setzero_ps();
            if (bias) b = widen_bf16(_mm256_maskz_loadu_epi16(mask, bias + n0));
            for (int64_t m = 0; m < rows; m++) {
                const __m512 v = _mm512_add_ps(_mm512_loadu_ps(sums[m]), b);
                _mm256_mask_storeu_epi16(y + m * n_len + n0, mask, (__m256i)_mm512_cvtneps_pbh(v));
            }
        }
    });
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* The tile GEMM, for the rows between the GEMV's and the packed GEMM's (AMX builds): small decode
   batches. It computes y^T = W x^T on the tile unit, so the weight is the row-major A
   operand read in place (no packed copy) and only x, a few KB, is laid out in pairs per call.
   Each block of 16 rows of W comes from memory once per call, into 16 x 16 result tiles. */
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_TILE_GEMM 1

constexpr int64_t TILE_MAX_ROWS = GEMM_TILE_MAX_ROWS; /* defined at build: above it, the packed GEMM */
static_assert(TILE_MAX_ROWS <= 16, "gemm_tiles lays x out as one block of 16 rows");

struct alignas(64) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* The OS hands out AMX state only on request (Linux: arch_prctl, once per process). */
bool amx_usable() {
    static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0;
    return granted;
}

/* r[i][j] <- r[j][i], 16 x 16 32-bit lanes. */
inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}

/* x [rows <= 16, k] -> xt [k / 2][16] words: xt[p][m] = (x[m][2p], x[m][2p + 1]), zero past
   rows; 16 x 16 blocks of words transposed in registers (k / 2 is a multiple of 16). */
void pairs_of_x(const uint16_t *x, int64_t x_stride, int64_t rows, int64_t k_len, uint32_t *xt) {
    for (int64_t p0 = 0; p0 < k_len / 2; p0 += 16) {
        __m512i r[16];
        for (int i = 0; i < 16; i++)
            r[i] = i < rows ? _mm512_loadu_si512(x + i * x_stride + 2 * p0) : _mm512_setzero_si512();
        transpose16(r);
        for (int j = 0; j < 16; j++) _mm512_store_si512(xt + (p0 + j) * 16, r[j]);
    }
}

/* Every tile 16 rows x 64 bytes: 0-3 fp32 results, 4-7 bf16 operands (16 rows x 32 k, or 16 k
   pairs x 16 columns). */
void tile_config(TileConfig *cfg) {
    memset(cfg, 0, sizeof *cfg);
    cfg->palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg->rows[t] = 16;
        cfg->colsb[t] = 64;
    }
}

/* Four blocks of 16 rows of W (from w) against x's block into result tiles 0-3 (W's last
   blocks: `count` of them). One result tile is a chain of dependent tile products (one per 32
   k), so four keep the tile unit busy, and each load of x serves all four. */
void tiles_4x1(int count, const uint16_t *w, int64_t k_len, const uint32_t *xt) {
    const int64_t step = k_len * 2; /* bytes between rows of W */
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t k = 0; k < k_len; k += 32) {
        _tile_loadd(6, xt + (k / 2) * 16, 64);
        _tile_loadd(4, w + k, step);
        _tile_dpbf16ps(0, 4, 6);
        if (count > 1) {
            _tile_loadd(5, w + 16 * k_len + k, step);
            _tile_dpbf16ps(1, 5, 6);
        }
        if (count > 2) {
            _tile_loadd(4, w + 32 * k_len + k, step);
            _tile_dpbf16ps(2, 4, 6);
        }
        if (count > 3) {
            _tile_loadd(5, w + 48 * k_len + k, step);
            _tile_dpbf16ps(3, 5, 6);
        }
    }
}

void store_results(int count, float (*out)[16][16]) {
    _tile_stored(0, out[0], 64);
    if (count > 1) _tile_stored(1, out[1], 64);
    if (count > 2) _tile_stored(2, out[2], 64);
    if (count > 3) _tile_stored(3, out[3], 64);
}

/* A result tile [16 rows of W from n0][16 rows of x] (+ bias), rounded to bf16, into y's rows. */
void write_result(const float (*tile)[16], const uint16_t *bias, uint16_t *y, int64_t n0, int64_t width,
                  int64_t rows, int64_t n_len) {
    const __mmask16 mask = (__mmask16)((1u << width) - 1);
    const __m512 b = bias ? widen_bf16(_mm256_maskz_loadu_epi16(mask, bias + n0)) : _mm512_setzero_ps();
    __m512i r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_load_si512(tile[i]);
    transpose16(r);
    for (int64_t i = 0; i < rows; i++) {
        const __m512 v = _mm512_add_ps(_mm512_castsi512_ps(r[i]), b);
        _mm256_mask_storeu_epi16(y + i * n_len + n0, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
}

/* y[m, n] = bias[n] + sum_k x[m, k] * w[n, k], rows <= TILE_MAX_ROWS (16: one block of x);
   w row-major [n_len, k_len], k_len a multiple of 32. fp32 sums, rounded once to bf16. */
void gemm_tiles(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                int64_t rows, int64_t n_len, int64_t k_len, int64_t x_stride) {
    /* 64-byte aligned (512-bit words), so no tile row straddles two cache lines; not zeroed, as
       pairs_of_x writes every word */
    const std::unique_ptr<__m512i[]> pairs(new __m512i[k_len / 2]);
    uint32_t *xt = reinterpret_cast<uint32_t *>(pairs.get());
    pairs_of_x(x, x_stride, rows, k_len, xt);
    const int64_t blocks = (n_len + 15) / 16;
    at::parallel_for(0, (blocks + 3) / 4, 1, [&](int64_t begin, int64_t end) {
        TileConfig cfg, saved; /* the thread's tile configuration (oneDNN's), restored after */
        _tile_storeconfig(&saved);
        tile_config(&cfg);
        _tile_loadconfig(&cfg);
        alignas(64) float out[4][16][16];
        std::vector<uint16_t> last; /* W's last rows, padded to a tile with zeros */
        for (int64_t g = begin; g < end; g++) {
            const int64_t n0 = g * 64;
            const int count = (int)std::min<int64_t>(blocks - g * 4, 4);
            const int64_t width = std::min<int64_t>(n_len - n0, 64); /* rows of W this group holds */
            const uint16_t *wg = w + n0 * k_len;
            if (width < 16 * count) {
                last.assign(16 * count * k_len, 0);
                memcpy(last.data(), wg, width * k_len * 2);
                wg = last.data();
            }
            tiles_4x1(count, wg, k_len, xt);
            store_results(count, out);
            for (int t = 0; t < count; t++) {
                const int64_t block_width = std::min<int64_t>(width - 16 * t, 16);
                write_result(out[t], bias, y, n0 + 16 * t, block_width, rows, n_len);
            }
        }
        if (saved.palette)
            _tile_loadconfig(&saved);
        else
            _tile_release();
    });
}

/* The GEMM on weights in pairs, on the tile unit (AMX builds; more rows than the tile GEMM
   takes). A panel of pairs ([k / 2][PANEL][2]) is the tile product's B operand as it lies: two
   16-column tiles whose rows (k pairs) are 128 bytes apart; x's rows are the A operand in place,
   so per call only a last partial block of rows is copied. A block is 32 rows x one panel, 2 x 2
   result tiles. Tiles are not renamed, so a block's conversion to bf16 held the tile unit up;
   each block's results are written while the next block's tile products run (PendingRows).
   Calls of PAIRS_SPLIT_ROWS rows or more are split over threads by rows (each thread every
   panel), fewer by panels. Outputs larger than STREAM_BYTES are written past the caches.
   Measured on a 2-core AMX Xeon (the model's 30 layers, docs/engine.md "Weights in pairs"). */
constexpr int64_t PAIRS_BLOCK_ROWS = 32;
constexpr int64_t PAIRS_ROW_CHUNK = 256; /* rows per pass over a thread's panels: x's chunk stays in L2 */
constexpr int64_t PAIRS_SPLIT_ROWS = 512;
constexpr int64_t STREAM_BYTES = 4 << 20;

/* A finished block's 2 x 2 result tiles ([x rows 0-15 | 16-31][B tile lo | hi]), written a few
   rows at a time as y's columns from n0 (BlockColumns) of `rows` rows from y_row. */
struct PendingRows {
    alignas(64) float tiles[4][16][16];
    int64_t y_row = 0, n0 = 0;
    int rows = 0, done = 0;
    bool gated = false;
    __mmask16 mask[2];
    __m512 add[2];

    void write(void *y, int64_t n_len, bool fp32_out, bool stream, int upto) {
        const __mmask32 both = (__mmask32)mask[0] | ((__mmask32)mask[1] << 16);
        for (; done < rows && done < upto; done++) {
            const int half = done / 16 * 2, r = done % 16;
            const __m512 lo = _mm512_add_ps(_mm512_load_ps(tiles[half][r]), add[0]);
            const __m512 hi = _mm512_add_ps(_mm512_load_ps(tiles[half + 1][r]), add[1]);
            const int64_t at = (y_row + done) * n_len + n0;
            if (gated) {
                store_gated(y, at, lo, hi);
                continue;
            }
            const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(hi, lo); /* 32 bf16, columns in order */
            if (fp32_out) {
                float *out = static_cast<float *>(y) + at;
                _mm512_mask_storeu_ps(out, mask[0], widen_bf16(_mm512_castsi512_si256(h)));
                _mm512_mask_storeu_ps(out + 16, mask[1], widen_bf16(_mm512_extracti64x4_epi64(h, 1)));
            } else if (stream && both == 0xffffffffu) {
                _mm512_stream_si512(reinterpret_cast<__m512i *>(static_cast<uint16_t *>(y) + at), h);
            } else {
                _mm512_mask_storeu_epi16(static_cast<uint16_t *>(y) + at, both, h);
            }
        }
    }
};

/* 32 rows of x (row stride x_stride) against two 16-column B tiles of pairs (b_lo, b_hi: rows 128
   bytes apart, as in a panel) into result tiles 0-3, writing `pending`'s rows as the products run. */
void pairs_block(const uint16_t *x, int64_t x_stride, const uint16_t *b_lo, const uint16_t *b_hi,
                 int64_t k_len, PendingRows &pending, void *y, int64_t n_len, bool fp32_out, bool stream) {
    const int64_t steps = k_len / 32;
    const int per_step = (int)((pending.rows + steps - 1) / steps);
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t s = 0; s < steps; s++) {
        _tile_loadd(4, b_lo + s * 32 * PANEL, 2 * PANEL * 2);
        _tile_loadd(5, b_hi + s * 32 * PANEL, 2 * PANEL * 2);
        _tile_loadd(6, x + s * 32, x_stride * 2);
        _tile_dpbf16ps(0, 6, 4);
        _tile_dpbf16ps(1, 6, 5);
        _tile_loadd(7, x + 16 * x_stride + s * 32, x_stride * 2);
        _tile_dpbf16ps(2, 7, 4);
        _tile_dpbf16ps(3, 7, 5);
        pending.write(y, n_len, fp32_out, stream, (int)(s + 1) * per_step);
    }
    pending.write(y, n_len, fp32_out, stream, PAIRS_BLOCK_ROWS);
}

/* gemm_pairs on the tile unit: the same arguments, k_len a multiple of 32. gated: w is [gate; up]
   and y [rows, n_len] gets silu(gate) * up (silu_times; n_len a multiple of 16, bf16 out): the
   model's MLP activation in the GEMM's writes, so the 2 x n_len sums never reach memory. */
void gemm_pairs_tiles(const uint16_t *x, const uint16_t *w, const uint16_t *bias, void *y, bool fp32_out,
                      int64_t rows, int64_t n_len, int64_t k_len, int64_t x_stride, bool gated) {
    const int64_t panels = column_blocks(n_len, gated);
    const int64_t full = rows / PAIRS_BLOCK_ROWS * PAIRS_BLOCK_ROWS;
    std::unique_ptr<__m512i[]> tail; /* the last rows, zero padded to a block, 64-byte aligned */
    if (rows > full) {
        tail.reset(new __m512i[PAIRS_BLOCK_ROWS * k_len / 32]());
        uint16_t *padded = reinterpret_cast<uint16_t *>(tail.get());
        for (int64_t r = full; r < rows; r++)
            memcpy(padded + (r - full) * k_len, x + r * x_stride, k_len * 2);
    }
    const bool stream = !gated && !fp32_out && n_len % PANEL == 0 && rows * n_len * 2 > STREAM_BYTES;
    auto run = [&](int64_t row_begin, int64_t row_end, int64_t panel_begin, int64_t panel_end) {
        TileConfig cfg, saved; /* the thread's tile configuration (oneDNN's), restored after */
        _tile_storeconfig(&saved);
        tile_config(&cfg);
        _tile_loadconfig(&cfg);
        PendingRows pending;
        pending.gated = gated;
        for (int64_t m0 = row_begin; m0 < row_end; m0 += PAIRS_ROW_CHUNK)
            for (int64_t p = panel_begin; p < panel_end; p++) {
                const BlockColumns c = block_columns(w, bias, p, n_len, k_len, gated);
                for (int64_t r = m0; r < std::min(row_end, m0 + PAIRS_ROW_CHUNK); r += PAIRS_BLOCK_ROWS) {
                    const bool in_place = r < full;
                    const uint16_t *rows_x = in_place ? x + r * x_stride : (const uint16_t *)tail.get();
                    pairs_block(rows_x, in_place ? x_stride : k_len, c.b_lo, c.b_hi, k_len, pending, y, n_len,
                                fp32_out, stream);
                    store_results(4, pending.tiles);
                    pending.y_row = r, pending.n0 = c.n0, pending.done = 0;
                    pending.rows = (int)std::min<int64_t>(PAIRS_BLOCK_ROWS, rows - r);
                    for (int j = 0; j < 2; j++) pending.mask[j] = c.mask[j], pending.add[j] = c.add[j];
                }
            }
        pending.write(y, n_len, fp32_out, stream, PAIRS_BLOCK_ROWS);
        if (stream) _mm_sfence(); /* streamed stores are weakly ordered: visible before the join */
        if (saved.palette)
            _tile_loadconfig(&saved);
        else
            _tile_release();
    };
    if (rows >= PAIRS_SPLIT_ROWS) {
        const int64_t blocks = (rows + PAIRS_BLOCK_ROWS - 1) / PAIRS_BLOCK_ROWS;
        at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
            run(begin * PAIRS_BLOCK_ROWS, std::min(rows, end * PAIRS_BLOCK_ROWS), 0, panels);
        });
    } else {
        at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) { run(0, rows, begin, end); });
    }
}
#endif
#else
/* AVX2 + FMA: each 32-bit lane of 16 loaded bf16 weights holds an even and an odd element,
   and (lane << 16), (lane & 0xffff0000) are the two as fp32, so a weight is widened in
   registers and only its 2 bytes cross the memory bus. x is split into its even and odd
   elements once per call to match. Products of bf16 values are exact in fp32; the sums are
   fp32 and the output is rounded once, as in the fp32 GEMM of the same values. */
static_assert(MAX_ROWS == 4, "gemv_bf16 below dispatches gemv_rows<R> for R = 1..4");
constexpr int64_t K_MULTIPLE = 16;

inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

inline uint16_t float_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

template <int R>
void gemv_rows(const float *xs, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t n_len,
               int64_t k_len) {
    const int64_t half = k_len / 2; /* xs: R rows of [even elements | odd elements] */
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    at::parallel_for(0, n_len, 64, [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; n++) {
            const uint16_t *row = w + n * k_len;
            __m256 even[R], odd[R];
            for (int r = 0; r < R; r++) even[r] = odd[r] = _mm256_setzero_ps();
            for (int64_t k = 0; k < k_len; k += 16) {
                if (k % 32 == 0) prefetch_ahead(row + k); /* one cache line */
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(row + k));
                const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
                const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(raw, high));
                for (int r = 0; r < R; r++) {
                    even[r] = _mm256_fmadd_ps(we, _mm256_loadu_ps(xs + r * k_len + k / 2), even[r]);
                    odd[r] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(xs + r * k_len + half + k / 2), odd[r]);
                }
            }
            const float b = bias ? bf16_to_float(bias[n]) : 0.0f;
            for (int r = 0; r < R; r++)
                y[r * n_len + n] = float_to_bf16(hsum(_mm256_add_ps(even[r], odd[r])) + b);
        }
    });
}

void gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t rows,
               int64_t n_len, int64_t k_len, int64_t x_stride) {
    std::vector<float> xs(rows * k_len);
    for (int64_t m = 0; m < rows; m++)
        for (int64_t k = 0; k < k_len; k++)
            xs[m * k_len + (k % 2) * (k_len / 2) + k / 2] = bf16_to_float(x[m * x_stride + k]);
    switch (rows) {
        case 1: gemv_rows<1>(xs.data(), w, bias, y, n_len, k_len); break;
        case 2: gemv_rows<2>(xs.data(), w, bias, y, n_len, k_len); break;
        case 3: gemv_rows<3>(xs.data(), w, bias, y, n_len, k_len); break;
        default: gemv_rows<4>(xs.data(), w, bias, y, n_len, k_len); break;
    }
}
#endif

using OptionalTensor = std::optional<at::Tensor>;
using Scalars = c10::List<std::optional<at::Scalar>>;

at::Tensor onednn_linear(const at::Tensor &x, const at::Tensor &packed, const OptionalTensor &bias) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                         .typed<at::Tensor(const at::Tensor &, const at::Tensor &, const OptionalTensor &,
                                           c10::string_view, Scalars, std::optional<c10::string_view>)>();
    return op.call(x, packed, bias, "none", Scalars(), std::nullopt);
}

/* oneDNN's fp32 GEMM of the half-precision values (packed: its layout of the weight in fp32),
   unrounded. */
at::Tensor fp32_gemm(const at::Tensor &x, const at::Tensor &packed, const OptionalTensor &bias) {
    const OptionalTensor fp32_bias = bias ? OptionalTensor(bias->to(at::kFloat)) : std::nullopt;
    return onednn_linear(x.to(at::kFloat), packed, fp32_bias);
}

/* fp32_gemm rounded once: a half-precision GEMM's arithmetic for CPUs without one. */
at::Tensor fp32_linear(const at::Tensor &x, const at::Tensor &packed, const OptionalTensor &bias) {
    return fp32_gemm(x, packed, bias).to(x.scalar_type());
}

/* Each fp32 value rounded to the nearest bf16 (ties to even; NaN the canonical one), kept in
   fp32: what .to(bf16).to(float) gives, in one pass and no allocation. */
void round_to_bf16_(at::Tensor &t) {
    uint32_t *p = static_cast<uint32_t *>(t.mutable_data_ptr());
    at::parallel_for(0, t.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; i++) {
            const uint32_t u = p[i];
            const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
            p[i] = nan ? 0x7fc00000u : (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
        }
    });
}

/* Whether a kernel on the original weight takes x: bf16 throughout, at most max_rows rows. */
bool in_place_takes(const at::Tensor &x, const at::Tensor &weight, const OptionalTensor &bias,
                    int64_t max_rows, int64_t k_multiple) {
    const int64_t k_len = x.size(-1);
    return x.numel() <= max_rows * k_len && k_len % k_multiple == 0 && weight.size(-1) == k_len &&
           x.scalar_type() == at::kBFloat16 &&
           weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
           (!bias || (bias->scalar_type() == at::kBFloat16 && bias->is_contiguous()));
}

bool gemv_takes(const at::Tensor &x, const at::Tensor &weight, const OptionalTensor &bias) {
    return in_place_takes(x, weight, bias, MAX_ROWS, K_MULTIPLE);
}

bool tiles_take(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &packed,
                const OptionalTensor &bias) {
#ifdef HAVE_TILE_GEMM
    return packed.scalar_type() != at::kFloat && in_place_takes(x, weight, bias, TILE_MAX_ROWS, 32) &&
           amx_usable();
#else
    return false;
#endif
}

/* x [..., K] @ w.T (+ bias) with w in pairs [ceil(N / PANEL), K / 2, PANEL, 2] (cpu_linear.py packs
   it only where this build has the kernel: AVX512-BF16); gated: silu(gate) * up of its halves,
   [..., N / 2] (N a multiple of 32). */
at::Tensor pairs_linear(const at::Tensor &x, const at::Tensor &packed, const OptionalTensor &bias,
                        int64_t n_len, bool fp32_out, bool gated = false) {
#if defined(__AVX512BF16__)
    const int64_t k_len = x.size(-1);
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
                "weights in pairs take bf16 inputs, got ", x.scalar_type());
    TORCH_CHECK(packed.size(1) * 2 == k_len && packed.size(2) == PANEL && packed.size(0) * PANEL >= n_len,
                "x's last dimension (", k_len, ") does not match the weight in pairs ", packed.sizes());
    TORCH_CHECK(!bias || (bias->scalar_type() == at::kBFloat16 && bias->is_contiguous()),
                "the bias of a weight in pairs must be contiguous bf16");
    at::Tensor rows = x.reshape({-1, k_len});
    if (rows.stride(1) != 1) rows = rows.contiguous();
    const at::Tensor w = packed.contiguous();
    const int64_t out_len = gated ? n_len / 2 : n_len;
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = out_len;
    at::Tensor out = at::empty(sizes, x.options().dtype(fp32_out ? at::kFloat : at::kBFloat16)
                                          .memory_format(at::MemoryFormat::Contiguous));
    if (rows.size(0) == 0) return out;
    const auto *xp = static_cast<const uint16_t *>(rows.const_data_ptr());
    const auto *wp = static_cast<const uint16_t *>(w.const_data_ptr());
    const auto *bp = bias ? static_cast<const uint16_t *>(bias->const_data_ptr()) : nullptr;
    const int64_t x_stride = rows.size(0) > 1 ? rows.stride(0) : k_len;
#ifdef HAVE_TILE_GEMM
    if (k_len % 32 == 0 && amx_usable()) {
        gemm_pairs_tiles(xp, wp, bp, out.mutable_data_ptr(), fp32_out, rows.size(0), out_len, k_len, x_stride,
                         gated);
        return out;
    }
#endif
    gemm_pairs(xp, wp, bp, out.mutable_data_ptr(), fp32_out, rows.size(0), out_len, k_len, x_stride, gated);
    return out;
#else
    TORCH_CHECK(false, "weights in pairs need the AVX512-BF16 build of this operator");
#endif
}

/* Whether a call reads the original weight in place (the GEMV, or the tile GEMM) rather than
   `packed`. Weights in pairs take every row count where the build has no tile unit (AVX512-BF16
   without AMX, where their GEMM was level with the GEMV at one row); with AMX the GEMV and the
   tile GEMM keep the decode rows they were measured faster at. */
bool reads_in_place(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &packed,
                    const OptionalTensor &bias) {
#ifndef HAVE_TILE_GEMM
    if (packed.dim() == 4) return false;
#endif
    return gemv_takes(x, weight, bias) || tiles_take(x, weight, packed, bias);
}

/* x [..., K] (any strides) @ weight [N, K].T (+ bias) -> [..., N]. packed: the weight in pairs,
   oneDNN's layout of it, or the weight in fp32 where the CPU has no native half-precision GEMM. */
at::Tensor packed_linear(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &packed,
                         const OptionalTensor &bias) {
    if (!reads_in_place(x, weight, packed, bias)) {
        if (packed.dim() == 4) return pairs_linear(x, packed, bias, weight.size(0), false);
        if (packed.scalar_type() == at::kFloat) return fp32_linear(x, packed, bias);
        return onednn_linear(x, packed, bias);
    }
    const bool gemv = gemv_takes(x, weight, bias);
    const int64_t k_len = x.size(-1), n_len = weight.size(0);
    at::Tensor rows = x.reshape({-1, k_len});
    if (rows.stride(1) != 1) rows = rows.contiguous();
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = n_len;
    at::Tensor out = at::empty(sizes, x.options().memory_format(at::MemoryFormat::Contiguous));
    if (rows.size(0) == 0) return out;
    const auto *xp = static_cast<const uint16_t *>(rows.const_data_ptr());
    const auto *wp = static_cast<const uint16_t *>(weight.const_data_ptr());
    const auto *bp = bias ? static_cast<const uint16_t *>(bias->const_data_ptr()) : nullptr;
    const int64_t x_stride = rows.size(0) > 1 ? rows.stride(0) : k_len;
    if (gemv)
        gemv_bf16(xp, wp, bp, static_cast<uint16_t *>(out.mutable_data_ptr()), rows.size(0), n_len, k_len,
                  x_stride);
#ifdef HAVE_TILE_GEMM
    else
        gemm_tiles(xp, wp, bp, static_cast<uint16_t *>(out.mutable_data_ptr()), rows.size(0), n_len, k_len,
                   x_stride);
#endif
    return out;
}

/* Whether packed_gated_linear runs as one GEMM: weights in pairs, for the rows that reach the GEMM
   on pairs (every row count without AMX). */
bool gated_in_one_gemm(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &packed,
                       const OptionalTensor &bias) {
    return packed.dim() == 4 && weight.size(0) % 32 == 0 && !reads_in_place(x, weight, packed, bias);
}

/* silu(x @ gate.T + b_gate) * (x @ up.T + b_up) for weight = [gate; up] (an MLP's gate and up
   linears, grouped as cpu_linear.py groups them), each value rounded where the model's own ops
   round it (silu_times). Compiled models reach it through gated_fusion.py. */
at::Tensor packed_gated_linear(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &packed,
                               const OptionalTensor &bias) {
    const int64_t n_len = weight.size(0), half = n_len / 2;
    TORCH_CHECK_VALUE(n_len > 0 && n_len % 2 == 0, "a gated linear's weight stacks its gate's and its up's ",
                      "rows: an even number of them, got ", n_len);
    if (gated_in_one_gemm(x, weight, packed, bias)) return pairs_linear(x, packed, bias, n_len, false, true);
    const at::Tensor y = packed_linear(x, weight, packed, bias).contiguous();
#if defined(__AVX512BF16__)
    if (y.scalar_type() == at::kBFloat16) {
        std::vector<int64_t> sizes = y.sizes().vec();
        sizes.back() = half;
        at::Tensor out = at::empty(sizes, y.options());
        gated_halves(static_cast<const uint16_t *>(y.const_data_ptr()),
                     static_cast<uint16_t *>(out.mutable_data_ptr()), y.numel() / n_len, half);
        return out;
    }
#endif
    const at::Tensor gate = y.narrow(-1, 0, half).to(at::kFloat);
    const at::Tensor silu = gate.div(gate.neg().exp().add(1)).to(y.scalar_type());
    return silu.to(at::kFloat).mul(y.narrow(-1, half, half).to(at::kFloat)).to(y.scalar_type());
}

/* packed_linear's values as fp32, for logits. The fp32 GEMM's output is rounded in place rather
   than converted to bf16 and back: for the default model's [64, 49152] logits in a decode step
   on a 2-core AVX2 EPYC those two conversions took ~4 ms each (torch.profiler). */
at::Tensor packed_logits(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &packed,
                         const OptionalTensor &bias) {
    if (packed.dim() == 4 && !reads_in_place(x, weight, packed, bias))
        return pairs_linear(x, packed, bias, weight.size(0), true);
    const bool fp32_bf16 = packed.scalar_type() == at::kFloat && x.scalar_type() == at::kBFloat16;
    if (fp32_bf16 && !gemv_takes(x, weight, bias)) {
        at::Tensor out = fp32_gemm(x, packed, bias).contiguous();
        round_to_bf16_(out);
        return out;
    }
    return packed_linear(x, weight, packed, bias).to(at::kFloat);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vmkv, m) {
    m.def("SCHEMA");
    m.def("LOGITS_SCHEMA");
    m.def("GATED_SCHEMA");
}
TORCH_LIBRARY_IMPL(vmkv, CompositeExplicitAutograd, m) {
    m.impl("packed_linear", &packed_linear);
    m.impl("packed_logits", &packed_logits);
    m.impl("packed_gated_linear", &packed_gated_linear);
}
"""
SOURCE = SOURCE.replace("LOGITS_SCHEMA", LOGITS_SCHEMA).replace("GATED_SCHEMA", GATED_SCHEMA)
SOURCE = SOURCE.replace("SCHEMA", SCHEMA)


_LIBRARIES: list[torch.library.Library] = []


@cache
def register() -> bool:
    """Define `vmkv::packed_linear` and `vmkv::packed_logits`, once per process; True if the C++
    kernels back them, False if the Python fallback (no GEMV: the GEMM for every row count) does."""
    isa = gemv_isa()
    native = isa is not None and _load_native(isa)
    if not native:
        library = torch.library.Library("vmkv", "FRAGMENT")
        library.define(SCHEMA)
        library.define(LOGITS_SCHEMA)
        library.define(GATED_SCHEMA)
        library.impl("packed_linear", _python_linear, "CompositeExplicitAutograd")
        library.impl("packed_logits", _python_logits, "CompositeExplicitAutograd")
        library.impl("packed_gated_linear", _python_gated, "CompositeExplicitAutograd")
        _LIBRARIES.append(library)  # the registration lives as long as the Library object
    torch.library.register_fake("vmkv::packed_linear")(_fake)
    torch.library.register_fake("vmkv::packed_logits")(_fake_logits)
    torch.library.register_fake("vmkv::packed_gated_linear")(_fake_gated)
    return native


# output columns per panel of a weight in pairs (PANEL in the source)
PAIRS_PANEL = 32


def pairs_gemm() -> bool:
    """Whether linears run the GEMM on weights in pairs here: bf16 on AVX512-BF16 CPUs, where the
    kernel builds (on the tile unit where the CPU has AMX and the OS grants it)."""
    return gemv_isa() == "avx512_bf16" and register()


def in_pairs(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (K even) as [ceil(N / PAIRS_PANEL), K / 2, PAIRS_PANEL, 2]: panels of output
    columns, each k pair of a column one 32-bit word; columns past N are zeros."""
    n, k = weight.shape
    padded = torch.nn.functional.pad(weight, (0, 0, 0, -n % PAIRS_PANEL))
    return padded.view(-1, PAIRS_PANEL, k // 2, 2).transpose(1, 2).contiguous()


def tile_max_rows() -> int:
    """Rows of x up to which packed_linear runs the tile GEMM after the GEMV: TILE_MAX_ROWS where
    the build has it (AVX512-BF16 with AMX tiles; it falls back to the packed GEMM where the OS refuses
    the tiles), else 0."""
    isa = gemv_isa()
    return TILE_MAX_ROWS if isa is not None and _has_tiles(isa) and register() else 0


def gated_gemm() -> bool:
    """Whether `vmkv::packed_gated_linear` computes a bf16 gate/up linear and its activation in one
    GEMM here (the GEMMs on pairs: AVX512-BF16 builds, on the tile unit or `vdpbf16ps`), so that
    fusing them pays."""
    return pairs_gemm()


def max_rows() -> int:
    """Rows of x up to which packed_linear runs the GEMV on this CPU, where the kernel builds
    (register() says whether it did); 0 where no build fits the CPU."""
    isa = gemv_isa()
    return _row_limit(isa) if isa is not None else 0


def gemv_isa() -> str | None:
    """The instruction set the GEMV kernel is built for on this CPU: AVX512-BF16, else AVX2 with
    FMA (torch's AVX2 capability requires both), else none."""
    if torch.cpu._is_avx512_bf16_supported():
        return "avx512_bf16"
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        return "avx2"
    return None


def _python_linear(
    x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    if packed.dim() == 4:  # weights in pairs: only packed where the C++ kernel runs
        return torch.nn.functional.linear(x, weight, bias)
    if packed.dtype == torch.float32:  # the C++ operator's fp32_linear
        fp32_bias = None if bias is None else bias.float()
        return torch.ops.mkldnn._linear_pointwise(x.float(), packed, fp32_bias, "none", [], "").to(x.dtype)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _fake(
    x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _python_logits(
    x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return _python_linear(x, weight, packed, bias).float()


def _fake_logits(
    x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32)


def _python_gated(
    x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    if weight.shape[0] == 0 or weight.shape[0] % 2:
        rows = weight.shape[0]
        raise ValueError(
            f"a gated linear's weight stacks its gate's and its up's rows: an even number, got {rows}"
        )
    gate, up = _python_linear(x, weight, packed, bias).float().chunk(2, dim=-1)
    return ((gate / (1 + (-gate).exp())).to(x.dtype).float() * up).to(x.dtype)


def _fake_gated(
    x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    torch._check(weight.shape[0] % 2 == 0, lambda: "a gated linear's weight needs an even number of rows")
    return x.new_empty(*x.shape[:-1], weight.shape[0] // 2)


def _load_native(isa: str) -> bool:
    try:
        torch.ops.load_library(str(_build(isa)))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        log.warning("bf16 GEMV kernel unavailable, decode linears use the GEMM: %s", build_failure(e))
        return False
    return True


def _build_flags(isa: str) -> tuple[str, ...]:
    tiles = ("-mamx-tile", "-mamx-bf16", f"-DGEMM_TILE_MAX_ROWS={TILE_MAX_ROWS}") if _has_tiles(isa) else ()
    return (*_FLAGS, *_ISA_FLAGS[isa], *tiles, f"-DGEMV_MAX_ROWS={_row_limit(isa)}")


def _has_tiles(isa: str) -> bool:
    """Whether the build has the tile GEMM: AVX512-BF16 on a CPU with AMX tiles."""
    return isa == "avx512_bf16" and torch.cpu._is_amx_tile_supported()


def _build(isa: str) -> Path:
    """Compile the source, or reuse an earlier build of the same source, flags and torch."""
    return build_torch_library("packed_linear", SOURCE, _build_flags(isa))
