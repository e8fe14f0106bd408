"""A paged decode-attention kernel for the CPU, compiled on first use.

Each one-token query reads its sequence's blocks straight from the pool, through the block
table, one block at a time with an online softmax: no context is gathered into a new tensor,
and the KV is read exactly once (converted to fp32 in registers). Shapes (head_dim, GQA group,
KV heads, block size) are compile-time constants, so loops unroll and the per-head
accumulators stay in vector registers; OpenMP spreads sequences over the cores.

The source is C with GCC/Clang vector extensions (no intrinsics, so any target works). It is
built with the system C compiler into a per-user cache directory keyed by a hash of source and
flags; without a compiler `load_decode_kernel` returns None and the torch path is used.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
#define NC (HEAD_DIM / 8)
#define NV ((BLOCK + 7) / 8)

#if defined(KV_BF16)
typedef uint16_t kv_t;
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
static inline v8 load8(const kv_t* p) {
    u16x8 raw; memcpy(&raw, p, 16);
    u32x8 wide = __builtin_convertvector(raw, u32x8) << 16;
    v8 r; memcpy(&r, &wide, 32); return r;
}
static inline kv_t store1(float f) {  /* round to nearest even */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (kv_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (kv_t)(u >> 16);
}
#elif defined(KV_F16)
typedef _Float16 kv_t;
typedef _Float16 f16x8 __attribute__((vector_size(16)));
static inline v8 load8(const kv_t* p) {
    f16x8 raw; memcpy(&raw, p, 16);
    return __builtin_convertvector(raw, v8);
}
static inline kv_t store1(float f) { return (kv_t)f; }
#else
typedef float kv_t;
static inline v8 load8(const kv_t* p) { v8 r; memcpy(&r, p, 32); return r; }
static inline kv_t store1(float f) { return f; }
#endif

static inline v8 splat(float x) { return (v8){x, x, x, x, x, x, x, x}; }
static inline float hsum(v8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }
static inline v8 vmax(v8 a, v8 b) { const v8i gt = a > b; return (v8)(((v8i)a & gt) | ((v8i)b & ~gt)); }

/* e^x for x <= 0 in eight lanes, as 2^n * 2^f with f in [-1/2, 1/2] (relative error ~1e-7);
   exactly 0 below -87, which also zeroes the padding lanes of a partial block. */
static inline v8 exp8(v8 x) {
    const v8i low = x < splat(-87.f);
    x = (v8)(((v8i)x & ~low) | ((v8i)splat(-87.f) & low));
    const v8 t = x * 1.44269504089f;
    const v8 n = (t + 12582912.f) - 12582912.f;  /* round to nearest */
    const v8 f = (t - n) * 0.69314718056f;
    v8 p = splat(1.f / 720);
    p = p * f + 1.f / 120; p = p * f + 1.f / 24; p = p * f + 1.f / 6;
    p = p * f + 0.5f; p = p * f + 1.f; p = p * f + 1.f;
    p = (v8)((v8i)p + (__builtin_convertvector(n, v8i) << 23));
    return (v8)((v8i)p & ~low);
}

/* Query heads of KV heads h0..h1-1 of one sequence over its whole context. */
static void attend(const kv_t* q, const kv_t* kc, const kv_t* vc, const int32_t* table, int64_t len,
                   kv_t* out, int h0, int h1, float scale) {
    const int64_t row = (int64_t)NUM_KV_HEADS * HEAD_DIM;  /* one token, all KV heads */
    const int64_t block_elems = BLOCK * row;
    v8 qv[NUM_KV_HEADS][GROUP][NC], acc[NUM_KV_HEADS][GROUP][NC];
    float m[NUM_KV_HEADS][GROUP], l[NUM_KV_HEADS][GROUP];
    v8 s[GROUP][NV];
    for (int h = h0; h < h1; h++)
        for (int g = 0; g < GROUP; g++) {
            for (int c = 0; c < NC; c++) {
                qv[h][g][c] = load8(q + (h * GROUP + g) * HEAD_DIM + c * 8) * scale;
                acc[h][g][c] = splat(0.f);
            }
            m[h][g] = -1e30f;
            l[h][g] = 0.f;
        }
    for (int64_t j = 0; j * BLOCK < len; j++) {
        const int n = len - j * BLOCK < BLOCK ? (int)(len - j * BLOCK) : BLOCK;
        const kv_t* kb = kc + table[j] * block_elems;
        const kv_t* vb = vc + table[j] * block_elems;
        if ((j + 1) * BLOCK < len) {  /* blocks are scattered: fetch the next one early */
            const char* nk = (const char*)(kc + table[j + 1] * block_elems);
            const char* nv = (const char*)(vc + table[j + 1] * block_elems);
            const int64_t size = block_elems * (int64_t)sizeof(kv_t);
            for (int64_t off = 0; off < size && off < 8192; off += 64) {
                __builtin_prefetch(nk + off);
                __builtin_prefetch(nv + off);
            }
        }
        for (int h = h0; h < h1; h++) {
            int t = 0;
            for (; t + 1 < n; t += 2) {  /* two tokens at a time: 2 * GROUP independent sums */
                v8 d0[GROUP], d1[GROUP];
                for (int g = 0; g < GROUP; g++) d0[g] = d1[g] = splat(0.f);
                for (int c = 0; c < NC; c++) {
                    const v8 k0 = load8(kb + t * row + h * HEAD_DIM + c * 8);
                    const v8 k1 = load8(kb + (t + 1) * row + h * HEAD_DIM + c * 8);
                    for (int g = 0; g < GROUP; g++) { d0[g] += qv[h][g][c] * k0; d1[g] += qv[h][g][c] * k1; }
                }
                for (int g = 0; g < GROUP; g++) {
                    ((float*)s[g])[t] = hsum(d0[g]);
                    ((float*)s[g])[t + 1] = hsum(d1[g]);
                }
            }
            if (t < n) {
                v8 d0[GROUP];
                for (int g = 0; g < GROUP; g++) d0[g] = splat(0.f);
                for (int c = 0; c < NC; c++) {
                    const v8 k0 = load8(kb + t * row + h * HEAD_DIM + c * 8);
                    for (int g = 0; g < GROUP; g++) d0[g] += qv[h][g][c] * k0;
                }
                for (int g = 0; g < GROUP; g++) ((float*)s[g])[t] = hsum(d0[g]);
            }
            const int nv = (n + 7) / 8;
            for (int g = 0; g < GROUP; g++) {
                for (int t = n; t < nv * 8; t++) ((float*)s[g])[t] = -1e30f;
                v8 top = s[g][0];
                for (int i = 1; i < nv; i++) top = vmax(top, s[g][i]);
                float mx = m[h][g];
                for (int i = 0; i < 8; i++) mx = top[i] > mx ? top[i] : mx;
                const float corr = exp8(splat(m[h][g] - mx))[0];
                v8 sum = splat(0.f);
                for (int i = 0; i < nv; i++) { s[g][i] = exp8(s[g][i] - mx); sum += s[g][i]; }
                m[h][g] = mx;
                l[h][g] = l[h][g] * corr + hsum(sum);
                for (int c = 0; c < NC; c++) acc[h][g][c] *= corr;
            }
            for (int c = 0; c < NC; c += CB) {  /* CB chunks of V at once: GROUP * CB independent sums */
                v8 a[GROUP][CB];
                for (int g = 0; g < GROUP; g++)
                    for (int b = 0; b < CB; b++) a[g][b] = acc[h][g][c + b];
                for (int t = 0; t < n; t++) {
                    v8 v[CB];
                    for (int b = 0; b < CB; b++) v[b] = load8(vb + t * row + h * HEAD_DIM + (c + b) * 8);
                    for (int g = 0; g < GROUP; g++) {
                        const v8 p = splat(((float*)s[g])[t]);
                        for (int b = 0; b < CB; b++) a[g][b] += p * v[b];
                    }
                }
                for (int g = 0; g < GROUP; g++)
                    for (int b = 0; b < CB; b++) acc[h][g][c + b] = a[g][b];
            }
        }
    }
    for (int h = h0; h < h1; h++)
        for (int g = 0; g < GROUP; g++) {
            const float inv = 1.f / l[h][g];
            kv_t* o = out + (h * GROUP + g) * HEAD_DIM;
            for (int c = 0; c < NC; c++)
                for (int i = 0; i < 8; i++) o[c * 8 + i] = store1(acc[h][g][c][i] * inv);
        }
}

/* q, out: [rows, NUM_KV_HEADS * GROUP, HEAD_DIM]; kc, vc: [blocks, BLOCK, NUM_KV_HEADS, HEAD_DIM];
   sequence b's query is row rows[b], its blocks tables[b * max_blocks ...], its length lens[b]. */
void paged_decode(const kv_t* q, const kv_t* kc, const kv_t* vc, const int32_t* tables, int64_t max_blocks,
                  const int32_t* lens, const int64_t* rows, kv_t* out, int64_t num_seqs, float scale,
                  int num_threads) {
    const int64_t q_row = (int64_t)NUM_KV_HEADS * GROUP * HEAD_DIM;
    int64_t work = 0;  /* (token, KV head) pairs: below a few thousand, waking threads costs more */
    for (int64_t b = 0; b < num_seqs; b++) work += (int64_t)lens[b] * NUM_KV_HEADS;
    if (work < 4096) num_threads = 1;
    if (num_seqs >= 4 * num_threads) {
        #pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
        for (int64_t b = 0; b < num_seqs; b++)
            attend(q + rows[b] * q_row, kc, vc, tables + b * max_blocks, lens[b], out + rows[b] * q_row,
                   0, NUM_KV_HEADS, scale);
    } else {  /* few sequences: one work item per KV head keeps every core busy */
        #pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
        for (int64_t item = 0; item < num_seqs * NUM_KV_HEADS; item++) {
            const int64_t b = item / NUM_KV_HEADS;
            const int h = (int)(item % NUM_KV_HEADS);
            attend(q + rows[b] * q_row, kc, vc, tables + b * max_blocks, lens[b], out + rows[b] * q_row,
                   h, h + 1, scale);
        }
    }
}
"""

_DTYPE_MACROS = {torch.bfloat16: "KV_BF16", torch.float16: "KV_F16", torch.float32: "KV_F32"}
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fPIC", "-shared"]
_loaded: dict[tuple, PagedDecodeKernel | None] = {}


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "vmkv" / "kernels"


def _build(defines: list[str]) -> Path:
    """Compile the kernel for these constants, or reuse an earlier build of the same source."""
    flags = [*_FLAGS, *defines]
    digest = hashlib.sha256((_SOURCE + " ".join(flags)).encode()).hexdigest()[:16]
    target = _cache_dir() / f"paged_decode_{digest}.so"
    if target.exists():
        return target
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise FileNotFoundError("no C compiler (set CC)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / "paged_decode.c"
        src.write_text(_SOURCE)
        built = Path(tmp) / target.name
        subprocess.run(
            [compiler, *flags, "-o", str(built), str(src)], check=True, capture_output=True, text=True
        )
        os.replace(built, target)  # atomic: concurrent builders leave one complete file
    return target


@dataclass
class PagedDecodeKernel:
    """The compiled kernel for one model shape; call it once per layer per step."""

    function: ctypes._CFuncPtr
    library: ctypes.CDLL  # kept alive as long as the function is

    def __call__(
        self,
        q: torch.Tensor,
        k_blocks: torch.Tensor,
        v_blocks: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
        rows: torch.Tensor,
        out: torch.Tensor,
        scale: float,
    ) -> None:
        """out[rows[b]] = attention of q[rows[b]] over lens[b] tokens in blocks tables[b].

        q/out: contiguous [T, Hq, D]; tables: int32 [B, max_blocks]; lens: int32 [B]; rows: int64 [B].
        """
        self.function(
            q.data_ptr(),
            k_blocks.data_ptr(),
            v_blocks.data_ptr(),
            tables.data_ptr(),
            tables.shape[1],
            lens.data_ptr(),
            rows.data_ptr(),
            out.data_ptr(),
            tables.shape[0],
            scale,
            torch.get_num_threads(),
        )


def load_decode_kernel(
    dtype: torch.dtype, num_kv_heads: int, group: int, head_dim: int, block_size: int
) -> PagedDecodeKernel | None:
    """The kernel for this shape, built on first use; None where it cannot be (no compiler,
    a dtype or head_dim it does not handle), so that the caller falls back to torch."""
    key = (dtype, num_kv_heads, group, head_dim, block_size)
    if key in _loaded:
        return _loaded[key]
    kernel = None
    if dtype in _DTYPE_MACROS and head_dim % 8 == 0:
        chunks = head_dim // 8
        # V chunks per pass: up to 8 accumulators, so that they stay in vector registers
        per_pass = max(c for c in range(1, chunks + 1) if chunks % c == 0 and c * group <= max(8, group))
        defines = [
            f"-D{_DTYPE_MACROS[dtype]}",
            f"-DCB={per_pass}",
            f"-DNUM_KV_HEADS={num_kv_heads}",
            f"-DGROUP={group}",
            f"-DHEAD_DIM={head_dim}",
            f"-DBLOCK={block_size}",
        ]
        try:
            library = ctypes.CDLL(str(_build(defines)))
            function = library.paged_decode
            function.restype = None
            p, i64 = ctypes.c_void_p, ctypes.c_int64
            function.argtypes = [p, p, p, p, i64, p, p, p, i64, ctypes.c_float, ctypes.c_int]
            kernel = PagedDecodeKernel(function, library)
        except (OSError, subprocess.CalledProcessError) as e:
            detail = e.stderr if isinstance(e, subprocess.CalledProcessError) else e
            log.warning("paged CPU decode kernel unavailable, using the torch path: %s", detail)
    _loaded[key] = kernel
    return kernel
