"""C source of the CPU decode-attention kernel (built by vmkv/decode_kernel.py).

One kernel reads every KV layout in place. A (sequence, KV head) pair's K row for token t
lives at `base + t * token_stride + head * head_stride`, where base is the sequence's slot
(dense layouts: vattention's virtual slots, head-major or token-major, and the contiguous
baseline) or, for the paged layout, `table[t / block] * block_stride + (t % block) * ...`.
So the same code serves all layouts and only the addressing differs.

Work: one item per (sequence, context piece), its KV heads in turn. All G query heads of a
KV head share one pass over its K and V (GQA). Long contexts with few sequences are split over
the threads (flash-decoding) and the partial softmax states are combined afterwards.

Per tile of V tokens (V = vector lanes: 16 with AVX-512, else 8): scores (a vector of partial
dot products per token and query row, then one transposing reduction tree per row), an online
softmax in base 2 (scale * log2(e) folded into the scores, fp32), and P V into all G rows. The
next tile's scores are computed while this tile's softmax chain resolves, and each row scored
prefetches the K row two tiles ahead and the V row one or two tiles ahead (and, at the end of
a range, the first rows of the range that runs next on the thread), so memory and compute
overlap. Two sets of primitives:
- generic (any KV type, AVX2 or AVX-512): K and V widened to fp32, FMA, P in fp32;
- bf16 K/V on AVX512-BF16: both products on vdpbf16ps (256-bit for the scores, so the tree
  is half as wide; P rounded to bf16 and token pairs of V interleaved for P V);
- and where the CPU has AMX tiles (bf16, GQA group <= 8; the OS asked for them once per
  process, falling back to vdpbf16ps where it refuses): both products of a tile on the tile
  unit, K and V rows loaded in place at their token stride. On a 2-core AMX Xeon, from memory
  (bench_kernels.py --quick --against=-DNO_AMX, one run), batch 64 took 0.80-0.85x the time of
  the vdpbf16ps build at 320 tokens and 0.77-0.90x at 2,048 over the five layouts; batch 4
  0.85-0.99x and 0.76-0.89x.
On one AVX512-BF16 core with K/V in cache (GQA group 3, head dim 64, 320 tokens), a token and
KV head took 14.5-15.1 ns before the bf16 primitives and the pipelining and ~10.8 ns after;
the generic path on AVX2 bf16, 21 -> 17.4 ns.
Shapes (G, head dim) are compile-time constants so the accumulators stay in registers.
"""

# 2^x in 16 fp32 lanes with AVX-512, for both attention kernels' softmax (also in
# prefill_kernel_source.py's SOURCE)
EXP2_PS = r"""
/* 2^x: round, a degree-6 polynomial on [-0.5, 0.5] (relative error ~2e-7), and vscalefps,
   which gives exactly 0 far below (masked scores of -1e30); -inf gives NaN. */
static inline __m512 exp2_ps(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 r = _mm512_set1_ps(1.5403530e-4f);
    r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(1.3333558e-3f));
    r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(9.6181291e-3f));
    r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(5.5504109e-2f));
    r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(2.4022651e-1f));
    r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(6.9314718e-1f));
    r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(r, n);
}
"""

# V-lane vector helpers and 2^x for x <= 0 on GCC vector types (vf, vi of V lanes defined
# first): the decode kernel's generic path and the sampler's draw kernel (draw_kernel.py)
VECTOR_EXP2 = r"""
static inline vf splat(float x) { return (vf){} + x; }
static inline vf select_v(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* 2^x for x <= 0 (relative error ~2e-7); exactly 0 below -126, so masked lanes vanish. */
static inline vf exp2_v(vf x) {
    const vi low = x < splat(-126.f);
    x = select_v(low, splat(-126.f), x);
    const vf n = (x + 12582912.f) - 12582912.f;  /* round to nearest */
    const vf f = (x - n) * 0.69314718056f;        /* 2^(x-n) = e^f, |f| <= 0.35 */
    vf p = splat(1.f / 720);
    p = p * f + 1.f / 120; p = p * f + 1.f / 24; p = p * f + 1.f / 6;
    p = p * f + 0.5f; p = p * f + 1.f; p = p * f + 1.f;
    p = (vf)((vi)p + (__builtin_convertvector(n, vi) << 23));
    return select_v(low, splat(0.f), p);
}
"""

SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(KV_BF16) && HEAD_DIM % 32 == 0
#include <immintrin.h>
#define USE_DPBF16 1
#endif

/* V lanes per vector; rows are handled in chunks of 2V elements loaded as two vectors. */
#if defined(__AVX512F__) && HEAD_DIM % 32 == 0
#define V 16
#else
#define V 8
#endif
#define NP (HEAD_DIM / (2 * V))
#define NC (2 * NP)  /* vectors per row */
typedef float vf __attribute__((vector_size(V * 4)));
typedef int32_t vi __attribute__((vector_size(V * 4)));
typedef uint32_t vu __attribute__((vector_size(V * 4)));

/* load2 reads elements [0, 2V) of p into two fp32 vectors. For bf16 the split is even /
   odd elements: each 32-bit lane holds two bf16, and (lane << 16), (lane & 0xffff0000) are
   the two as fp32 (2 ops for 2V elements). Other types split into halves. Accumulators keep
   the same order; store2 is load2's inverse, for the output. */
#if defined(KV_BF16)
typedef uint16_t kv_t;
static inline void load2(const kv_t* p, vf* a, vf* b) {
    vu raw; memcpy(&raw, p, sizeof raw);
    const vu lo = raw << 16, hi = raw & 0xffff0000u;
    memcpy(a, &lo, sizeof *a); memcpy(b, &hi, sizeof *b);
}
static inline void store2(kv_t* p, vf a, vf b) {  /* round to nearest even; NaN stays NaN */
    vu ua, ub; memcpy(&ua, &a, sizeof ua); memcpy(&ub, &b, sizeof ub);
    const vu nan_a = (vu)(a != a), nan_b = (vu)(b != b);
    ua = ((ua + 0x7fffu + ((ua >> 16) & 1u)) & ~nan_a) | (0x7fc00000u & nan_a);
    ub = ((ub + 0x7fffu + ((ub >> 16) & 1u)) & ~nan_b) | (0x7fc00000u & nan_b);
    const vu packed = (ua >> 16) | (ub & 0xffff0000u);
    memcpy(p, &packed, sizeof packed);
}
#else
#if defined(KV_F16)
typedef _Float16 kv_t;
typedef _Float16 vhf __attribute__((vector_size(V * 2)));
static inline vf load_v(const kv_t* p) {
    vhf raw; memcpy(&raw, p, sizeof raw); return __builtin_convertvector(raw, vf);
}
#else
typedef float kv_t;
static inline vf load_v(const kv_t* p) { vf r; memcpy(&r, p, sizeof r); return r; }
#endif
static inline void load2(const kv_t* p, vf* a, vf* b) { *a = load_v(p); *b = load_v(p + V); }
static inline void store2(kv_t* p, vf a, vf b) {
    for (int i = 0; i < V; i++) { p[i] = (kv_t)a[i]; p[V + i] = (kv_t)b[i]; }
}
#endif
static inline void load_row(const kv_t* p, vf* r) {  /* r[NC] */
    for (int c = 0; c < NP; c++) load2(p + c * 2 * V, &r[2 * c], &r[2 * c + 1]);
}

VECTOR_EXP2
static inline vf vmax(vf a, vf b) { return select_v(a > b, a, b); }
static inline vf lane_ids(void) {
    vf r; for (int i = 0; i < V; i++) r[i] = (float)i; return r;
}


typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));
/* SH shuffles two V-lane vectors, SH8 two 8-lane ones */
#if defined(__clang__) || __GNUC__ >= 12
#define SH(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#define SH8 SH
#else  /* older GCC: the same shuffles with a mask vector (checked by forcing this branch on GCC 12) */
#define SH(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
#define SH8(a, b, ...) __builtin_shuffle(a, b, (vi8){__VA_ARGS__})
#endif

/* Lane i of the result = sum of all 8 lanes of a[i] (a transposing tree, 3 levels); the
   8-lane case of reduce_rows, and the AVX512-BF16 path's 256-bit scores. The first two levels
   shuffle within 128-bit halves (vshufps); only the last crosses them. */
static inline vf8 reduce8(const vf8* a) {
    vf8 b[4], c[2];
    for (int j = 0; j < 4; j++)  /* b[j] = pair sums of a[2j], a[2j+1], per half */
        b[j] = SH8(a[2*j], a[2*j+1], 0, 1, 8, 9, 4, 5, 12, 13)
             + SH8(a[2*j], a[2*j+1], 2, 3, 10, 11, 6, 7, 14, 15);
    for (int j = 0; j < 2; j++)  /* c[j] = half sums of a[4j..4j+3]: low halves, then high */
        c[j] = SH8(b[2*j], b[2*j+1], 0, 2, 8, 10, 4, 6, 12, 14)
             + SH8(b[2*j], b[2*j+1], 1, 3, 9, 11, 5, 7, 13, 15);
    return SH8(c[0], c[1], 0, 1, 2, 3, 8, 9, 10, 11) + SH8(c[0], c[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* Lane i of the result = sum of all lanes of a[i]: a transposing tree, log2(V) levels. */
static inline vf reduce_rows(vf* a) {
#if V == 16
    vf b[8], c[4], d[2];
    for (int j = 0; j < 8; j++)
        b[j] = SH(a[2*j], a[2*j+1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + SH(a[2*j], a[2*j+1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int j = 0; j < 4; j++)
        c[j] = SH(b[2*j], b[2*j+1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
             + SH(b[2*j], b[2*j+1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int j = 0; j < 2; j++)
        d[j] = SH(c[2*j], c[2*j+1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
             + SH(c[2*j], c[2*j+1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return SH(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + SH(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
    return reduce8(a);
#endif
}
/* Lane 0 of the result = max / sum over all lanes (log2(V) shuffles, not V extracts). */
#if V == 16
#define FOLD(x, op) do { \
    x = op(x, SH(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7)); \
    x = op(x, SH(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11)); \
    x = op(x, SH(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13)); \
    x = op(x, SH(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14)); } while (0)
#else
#define FOLD(x, op) do { \
    x = op(x, SH(x, x, 4, 5, 6, 7, 0, 1, 2, 3)); \
    x = op(x, SH(x, x, 2, 3, 0, 1, 6, 7, 4, 5)); \
    x = op(x, SH(x, x, 1, 0, 3, 2, 5, 4, 7, 6)); } while (0)
#endif
static inline vf add_v(vf a, vf b) { return a + b; }
static inline float hmax(vf x) { FOLD(x, vmax); return x[0]; }
static inline float hsum(vf x) { FOLD(x, add_v); return x[0]; }

/* Per step: where every sequence's K/V lives; the same for every layer. Strides in elements. */
typedef struct {
    const int64_t* rows;     /* [B] query (and output) row of each sequence */
    const int32_t* lens;     /* [B] context lengths */
    const int64_t* seq_base; /* [B] dense layouts: element offset of token 0, head 0; else NULL */
    const int32_t* tables;   /* [B, table_width] paged layout: block ids; else NULL */
    int64_t table_width, num_seqs, block_size, block_stride, token_stride, head_stride;
    int64_t num_kv_heads, min_split;
} plan_t;

typedef struct { float m[GROUP], l[GROUP]; float acc[GROUP][HEAD_DIM]; } partial_t;

/* Offsets (elements, head 0) of sequence b's tokens from t on: a run of `left` rows at the token
   stride from `base`; paged, each block's run starts when the cursor reaches it (block blk, from
   row off), so a table entry is read once per block and never past the tokens walked. Looked up
   per row before (a table load and two multiplies for each of the two cursors' rows): the paged
   kernel took 0.91-0.95x that time at batch 64 on scattered blocks (2-core AMX Xeon, both builds in
   one bench_kernels run, two runs), the dense orders level. */
typedef struct { const plan_t* p; int64_t b, base, left, blk, off; } cursor_t;
static inline void cursor_start(cursor_t* c, const plan_t* p, int64_t b, int64_t t) {
    *c = (cursor_t){.p = p, .b = b};
    if (p->tables) { c->blk = t / p->block_size; c->off = t % p->block_size; }
    else { c->base = p->seq_base[b] + t * p->token_stride; c->left = INT64_MAX; }
}
static inline int64_t cursor_next(cursor_t* c) {  /* offset of the current token, then advance */
    const plan_t* p = c->p;
    if (!c->left) {
        c->base = p->tables[c->b * p->table_width + c->blk++] * p->block_stride + c->off * p->token_stride;
        c->left = p->block_size - c->off;
        c->off = 0;
    }
    c->left--;
    const int64_t r = c->base;
    c->base += p->token_stride;
    return r;
}

/* A tile's V rows (rows past the context point at zeros, so no loop branches on the length)
   and its scores, scaled, in base 2 and -1e30 past the context. */
static const kv_t zero_row[HEAD_DIM];
typedef struct { const kv_t* v[V]; vf s[GROUP]; } tile_t;

#ifdef USE_DPBF16
/* AVX512-BF16: both products on vdpbf16ps.
   - Scores on 256-bit products: 8 partial sums per token and query row, so the transposing
     reduction is half as wide as with 512-bit ones (21 instead of 45 full-width operations
     per 16 tokens and row).
   - P V: P rounded to bf16 (as FlashAttention does for its P V product) and two tokens' V
     rows interleaved element-wise, so one vdpbf16ps adds both tokens into 16 output lanes.
     Lane 4k+e of acc[2c] holds dimension 32c+8k+e, of acc[2c+1] dimension 32c+8k+4+e;
     store_acc puts them back in natural order. */
typedef __m256bh qrow_t[HEAD_DIM / 16];
typedef uint32_t weights_t[V / 2];  /* P of tokens (2j, 2j+1) as two bf16 */
static inline void load_q(const kv_t* q, qrow_t r) {
    for (int c = 0; c < HEAD_DIM / 16; c++) r[c] = (__m256bh)_mm256_loadu_si256((const __m256i*)(q + c * 16));
}

static inline void score_rows(const kv_t* const* kr, const qrow_t* q, vf* sums) {
    vf8 part[GROUP][V];
    for (int i = 0; i < V; i++) {
        __m256 d[GROUP];
        for (int g = 0; g < GROUP; g++) d[g] = _mm256_setzero_ps();
        for (int c = 0; c < HEAD_DIM / 16; c++) {
            const __m256bh kb = (__m256bh)_mm256_loadu_si256((const __m256i*)(kr[i] + c * 16));
            for (int g = 0; g < GROUP; g++) d[g] = _mm256_dpbf16_ps(d[g], kb, q[g][c]);
        }
        for (int g = 0; g < GROUP; g++) memcpy(&part[g][i], &d[g], sizeof(vf8));
    }
    for (int g = 0; g < GROUP; g++) {
        const vf8 half[2] = {reduce8(part[g]), reduce8(part[g] + 8)};
        memcpy(&sums[g], half, sizeof half);
    }
}

EXP2_PS
static inline vf exp2_tile(vf x) {
    __m512 xm;
    memcpy(&xm, &x, sizeof xm);
    const __m512 r = exp2_ps(xm);
    vf out;
    memcpy(&out, &r, sizeof out);
    return out;
}

static inline void to_weights(vf p, weights_t* w) {
    __m512 pm;
    memcpy(&pm, &p, sizeof pm);
    _mm256_storeu_si256((__m256i*)*w, (__m256i)_mm512_cvtneps_pbh(pm));
}

static inline void accumulate_pv(vf acc[GROUP][NC], const tile_t* tl, int n, const weights_t* w) {
    for (int i = 0; i < n; i += 2) {
        for (int c = 0; c < HEAD_DIM / 32; c++) {
            const __m512i a = _mm512_loadu_si512(tl->v[i] + c * 32);
            const __m512i z = _mm512_loadu_si512(tl->v[i + 1] + c * 32);
            const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, z);
            const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(a, z);
            for (int g = 0; g < GROUP; g++) {
                const __m512bh pair = (__m512bh)_mm512_set1_epi32((int)w[g][i / 2]);
                acc[g][2 * c] = (vf)_mm512_dpbf16_ps((__m512)acc[g][2 * c], lo, pair);
                acc[g][2 * c + 1] = (vf)_mm512_dpbf16_ps((__m512)acc[g][2 * c + 1], hi, pair);
            }
        }
    }
}

/* Dimensions 32c.. of the output from acc[2c] and acc[2c + 1], lanes picked by first/second. */
static inline void store_acc_as(float* dst, const vf* acc, __m512i first, __m512i second) {
    for (int c = 0; c < HEAD_DIM / 32; c++) {
        const __m512 a = (__m512)acc[2 * c], b = (__m512)acc[2 * c + 1];
        _mm512_storeu_ps(dst + 32 * c, _mm512_permutex2var_ps(a, first, b));
        _mm512_storeu_ps(dst + 32 * c + 16, _mm512_permutex2var_ps(a, second, b));
    }
}

static inline void store_acc(float* dst, const vf* acc) {
    store_acc_as(dst, acc, _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23),
                 _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31));
}

/* The state's accumulators are in natural order. */
static void write_out(kv_t* o, const partial_t* st) {
    for (int g = 0; g < GROUP; g++) {
        const __m512 inv = _mm512_set1_ps(1.f / st->l[g]);
        for (int c = 0; c < HEAD_DIM / 16; c++) {
            const __m256bh r = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(st->acc[g] + 16 * c), inv));
            _mm256_storeu_si256((__m256i*)(o + g * HEAD_DIM + 16 * c), (__m256i)r);
        }
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && GROUP <= 8 && !defined(NO_AMX)
/* AMX (Xeon): both products of a tile on the tile unit, reading K and V rows straight from the
   cache at its token stride (paged block edges and a range's tail, whose rows are not one
   stride apart or lie past the context, are copied into a buffer first).
   - Scores: S^T [16 tokens][GROUP] = K [16 tokens][32 dims] x Q^T [16 dim pairs][GROUP] per 32
     dimensions, Q packed once per range; no reduction tree. Stored GROUP floats a row and
     split into one 16-lane vector per query row.
   - P V: V's rows taken as they are as the pair-interleaved operand (a row's 32 dimensions =
     16 pairs), so no interleaving pass: P goes in twice, row g with each token's weight in the
     even half of its pair and row GROUP + g in the odd half, giving the even dimensions of
     query row g in output row g and the odd ones in row GROUP + g (half the tile's products
     are zeros; the unit has them to spare). Output rows are added into the accumulators,
     which stay in registers for the online softmax. */
#define USE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
typedef struct __attribute__((aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;
#define TILE_S 0  /* literal numbers: GCC's tile intrinsics paste them into register names */
#define TILE_K 1
#define TILE_Q 2
#define TILE_P 3
#define TILE_V 4
#define TILE_O 5
typedef uint32_t qpack_t[HEAD_DIM / 32][16][GROUP];  /* Q^T in pairs of dimensions */

/* The OS hands out AMX state only on request (Linux: arch_prctl, once per process); where it
   refuses, the vdpbf16ps scores above run instead. */
static int amx_usable(void) {
    static int state;  /* 0 not asked yet, 1 granted, -1 refused */
    int s = __atomic_load_n(&state, __ATOMIC_RELAXED);
    if (!s) {
        s = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0 ? 1 : -1;
        __atomic_store_n(&state, s, __ATOMIC_RELAXED);
    }
    return s > 0;
}

static void amx_config(tilecfg_t* cfg) {
    memset(cfg, 0, sizeof *cfg);
    cfg->palette = 1;
    cfg->rows[TILE_S] = 16; cfg->colsb[TILE_S] = GROUP * 4;
    cfg->rows[TILE_K] = 16; cfg->colsb[TILE_K] = 64;
    cfg->rows[TILE_Q] = 16; cfg->colsb[TILE_Q] = GROUP * 4;
    cfg->rows[TILE_P] = 2 * GROUP; cfg->colsb[TILE_P] = 64;
    cfg->rows[TILE_V] = 16; cfg->colsb[TILE_V] = 64;
    cfg->rows[TILE_O] = 2 * GROUP; cfg->colsb[TILE_O] = 64;
}

static inline void pack_q(const kv_t* q, qpack_t qp) {
    for (int g = 0; g < GROUP; g++)
        for (int c = 0; c < HEAD_DIM / 32; c++)
            for (int j = 0; j < 16; j++) memcpy(&qp[c][j][g], q + g * HEAD_DIM + 32 * c + 2 * j, 4);
}

/* Where a tile's 16 rows can be loaded from: in place at the cache's token stride, or copied. */
static inline const kv_t* tile_rows(const kv_t* const* r, int64_t* stride, kv_t (*buf)[HEAD_DIM]) {
    int in_place = 1;
    for (int i = 1; i < V; i++) in_place &= r[i] == r[0] + i * *stride;
    if (in_place) return r[0];
    for (int i = 0; i < V; i++) memcpy(buf[i], r[i], sizeof buf[i]);
    *stride = HEAD_DIM;
    return buf[0];
}

static inline void score_rows_amx(const kv_t* const* kr, const qpack_t qp, vf* sums, int64_t stride) {
    kv_t rows[V][HEAD_DIM] __attribute__((aligned(64)));
    const kv_t* base = tile_rows(kr, &stride, rows);
    _tile_zero(TILE_S);
    for (int c = 0; c < HEAD_DIM / 32; c++) {
        _tile_loadd(TILE_K, base + 32 * c, stride * (int64_t)sizeof(kv_t));
        _tile_loadd(TILE_Q, qp[c], GROUP * 4);
        _tile_dpbf16ps(TILE_S, TILE_K, TILE_Q);
    }
    float s[V * GROUP] __attribute__((aligned(64)));
    _tile_stored(TILE_S, s, GROUP * 4);
    /* lane i of row g is s[i * GROUP + g]: GROUP masked permutes from each of GROUP vectors */
    __m512 part[GROUP];
    for (int j = 0; j < GROUP; j++) part[j] = _mm512_load_ps(s + 16 * j);
    for (int g = 0; g < GROUP; g++) {
        __m512 r = _mm512_setzero_ps();
        for (int j = 0; j < GROUP; j++) {
            int32_t index[16];
            __mmask16 mask = 0;
            for (int i = 0; i < 16; i++) {
                index[i] = (i * GROUP + g) % 16;
                if ((i * GROUP + g) / 16 == j) mask |= (__mmask16)(1u << i);
            }
            r = _mm512_mask_permutexvar_ps(r, mask, _mm512_loadu_si512(index), part[j]);
        }
        memcpy(&sums[g], &r, sizeof r);
    }
}

static inline void accumulate_pv_amx(vf acc[GROUP][NC], const tile_t* tl, const weights_t* w,
                                     int64_t stride) {
    uint32_t p[2 * GROUP][16] __attribute__((aligned(64)));
    for (int g = 0; g < GROUP; g++) {
        const __m512i even = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)w[g]));
        _mm512_store_si512(p[g], even);
        _mm512_store_si512(p[GROUP + g], _mm512_slli_epi32(even, 16));
    }
    kv_t rows[V][HEAD_DIM] __attribute__((aligned(64)));
    const kv_t* base = tile_rows(tl->v, &stride, rows);
    _tile_loadd(TILE_P, p, 64);
    for (int c = 0; c < HEAD_DIM / 32; c++) {
        float o[2 * GROUP][16] __attribute__((aligned(64)));
        _tile_zero(TILE_O);
        _tile_loadd(TILE_V, base + 32 * c, stride * (int64_t)sizeof(kv_t));
        _tile_dpbf16ps(TILE_O, TILE_P, TILE_V);
        _tile_stored(TILE_O, o, 64);
        for (int g = 0; g < GROUP; g++) {
            vf even, odd;
            memcpy(&even, o[g], sizeof even);
            memcpy(&odd, o[GROUP + g], sizeof odd);
            acc[g][2 * c] += even;
            acc[g][2 * c + 1] += odd;
        }
    }
}

/* acc[2c] holds the even dimensions of chunk c, acc[2c + 1] the odd ones. */
static inline void store_acc_amx(float* dst, const vf* acc) {
    store_acc_as(dst, acc, _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23),
                 _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31));
}
#endif
#else
/* Generic (any KV type, AVX2 or AVX-512): K and V widened to fp32 (load_row's order), FMA,
   P in fp32. */
typedef vf qrow_t[NC];
typedef vf weights_t;

static inline void load_q(const kv_t* q, qrow_t r) { load_row(q, r); }

static inline void score_rows(const kv_t* const* kr, const qrow_t* q, vf* sums) {
    vf part[GROUP][V];
    for (int i = 0; i < V; i++) {
        vf d[GROUP], k[NC];
        for (int g = 0; g < GROUP; g++) d[g] = splat(0.f);
        load_row(kr[i], k);
        for (int c = 0; c < NC; c++)
            for (int g = 0; g < GROUP; g++) d[g] += q[g][c] * k[c];
        for (int g = 0; g < GROUP; g++) part[g][i] = d[g];
    }
    for (int g = 0; g < GROUP; g++) sums[g] = reduce_rows(part[g]);
}

static inline vf exp2_tile(vf x) { return exp2_v(x); }
static inline void to_weights(vf p, weights_t* w) { *w = p; }

/* P V a chunk of 2V dimensions at a time, over the tile's tokens, so the chunk's 2 * GROUP
   accumulators stay in registers: all GROUP * NC of them (24 with AVX2 at head dim 64) do not
   fit in AVX2's 16, and token by token they were loaded and stored for every FMA. With the
   weights broadcast once per tile and fmaxf inlined, one AVX2 core with K/V in cache took
   30.0 against 33.8 ns per token and KV head, and batch 64 at 320 tokens from memory on two
   (head-major) 0.75 against 0.98 ms per layer (2,048 tokens: 4.9 against 6.0). */
static inline void pv_chunks(vf acc[GROUP][NC], const tile_t* tl, int n, const vf (*pw)[GROUP]) {
    for (int c = 0; c < NP; c++) {
        vf a[GROUP][2];
        for (int g = 0; g < GROUP; g++) { a[g][0] = acc[g][2 * c]; a[g][1] = acc[g][2 * c + 1]; }
        for (int i = 0; i < n; i++) {
            vf lo, hi;
            load2(tl->v[i] + c * 2 * V, &lo, &hi);
            for (int g = 0; g < GROUP; g++) { a[g][0] += pw[i][g] * lo; a[g][1] += pw[i][g] * hi; }
        }
        for (int g = 0; g < GROUP; g++) { acc[g][2 * c] = a[g][0]; acc[g][2 * c + 1] = a[g][1]; }
    }
}

static inline void accumulate_pv(vf acc[GROUP][NC], const tile_t* tl, int n, const weights_t* w) {
    vf pw[V][GROUP];
    for (int i = 0; i < V; i++)
        for (int g = 0; g < GROUP; g++) pw[i][g] = splat(w[g][i]);
    if (n == V) pv_chunks(acc, tl, V, pw);  /* a constant trip count, unrolled */
    else pv_chunks(acc, tl, n, pw);
}

static inline void store_acc(float* dst, const vf* acc) { memcpy(dst, acc, NC * sizeof(vf)); }

/* The state's accumulators are in load_row's order; store2 puts them back in place. */
static void write_out(kv_t* o, const partial_t* st) {
    for (int g = 0; g < GROUP; g++) {
        const float inv = 1.f / st->l[g];
        for (int c = 0; c < NP; c++) {
            vf a, b;
            memcpy(&a, st->acc[g] + 2 * c * V, sizeof a);
            memcpy(&b, st->acc[g] + (2 * c + 1) * V, sizeof b);
            store2(o + g * HEAD_DIM + c * 2 * V, a * inv, b * inv);
        }
    }
}
#endif

/* Tokens in the tile starting at t of a range ending at t1. */
static inline int tile_len(int64_t t, int64_t t1) { return t1 - t < V ? (int)(t1 - t) : V; }

/* Rows are prefetched by a second cursor, one row for every row scored, so the misses
   in flight stay level while the tile computes: a row's K lines PREFETCH_ROWS rows ahead of its
   scoring, and its V lines `lag` rows later (a ring keeps their offsets), since P V reads a
   tile's V one tile after scoring it. The lag is V rows where rows are scattered (layer-packed,
   token-major, paged) and 0 where a head's rows are one run (head-major). On a 2-core AVX2 Zen
   3 at batch 64, K/V from memory, against V prefetched with K (so three tiles before its use;
   both builds in one process on the same tensors, 21 interleaved rounds, two runs): layer-packed
   took 0.79-0.89x the time at 320 and 2,048 tokens, token-major 0.86-1.00x, paged 0.76-0.94x
   scattered and 0.84-0.96x with blocks in runs, head-major 1.00-1.02x (a lag there too took
   it 1.02-1.15x).
   Issued in a burst of a tile's rows into L2 instead, at batch 64 on a Zen 5 EPYC (43 GB/s copy
   bandwidth) the kernel ran at the sum of its compute and memory times, not the larger:
   0.53-0.66 against 0.51-0.54 ms per layer at 320 tokens token-major, 0.59-0.65 against
   0.53-0.54 layer-packed, 0.65-0.66 against 0.61 paged, 4.9 against 4.5 ms at 2,048
   layer-packed (bench_kernels.py). Head-major runs are prefetched too: there the hardware
   prefetcher alone gave 0.80 against 0.52 ms at 320 tokens, 4.1 against 2.7 ms at 2,048.
   PREFETCH_LOCALITY (the build's -D, per CPU kind: decode_kernel.py) is where the lines go:
   3 into L1 (prefetcht0), 2 into L2 (prefetcht1). On a 2-core Zen 4 EPYC the same level
   prefetches into L2 read from memory nearly twice as fast at batch 64 (layer-packed 1.29-1.35
   -> 0.72-0.73 ms per layer at 320 tokens, 8.2 -> 4.4-4.6 at 2,048; paged 1.33-1.34 ->
   0.72-0.76; head-major 0.77-0.80 -> 0.58-0.64, at the roofline at 2,048), as did a plain C
   walk of the layer-packed rows (2,048 tokens: 5.4-5.7 -> 2.9 ms): L1's few miss buffers held
   the prefetches back. One, three or four tiles ahead into L2 measured within 10% of two,
   none better on every layout; a V lag of 0 or 8 rows, within 5% of V.
   Once a range's own rows are all issued, the cursor goes on into the first PREFETCH_ROWS rows
   (K and V) of the range the thread runs next, which the caller names: the chunk's next KV
   head, or the next chunk's first. A sequence's heads run one after another (192 range starts
   a layer at batch 64), and each started on a cold stream before. Both builds in one process on
   the same tensors, 2-core Zen 4 EPYC, batch 64, interleaved (medians of 15 calls, 3-6 rounds):
   at 320 tokens head-major took 0.86-0.90x the time, token-major 0.92-1.01x, layer-packed
   0.88-1.03x, paged 0.97-1.02x scattered and 0.94-0.98x in runs; at 2,048 tokens 0.96-0.97x,
   0.95-0.99x, 0.95-1.00x, 0.98-1.03x and 0.99x. The next piece of work (another sequence) is not
   chained: the dynamic schedule decides which thread takes it. */
#define PREFETCH_ROWS (2 * V)
typedef struct { int64_t b, h, t0, t1; } range_t;  /* tokens [t0, t1) of sequence b, KV head h; empty: none */
typedef struct {
    cursor_t cursor; int64_t issued, count, lag; int64_t ring[2 * V];
    cursor_t next; int64_t next_left; const kv_t *nkc, *nvc;
} ahead_t;
static inline void prefetch_lines(const kv_t* row) {
    for (int c = 0; c < (int)(HEAD_DIM * sizeof(kv_t)); c += 64)
        __builtin_prefetch((const char*)row + c, 0, PREFETCH_LOCALITY);
}
static inline void prefetch_row(ahead_t* a, const kv_t* kc, const kv_t* vc) {
    const int64_t i = a->issued++;
    if (i < a->count) {
        const int64_t r = cursor_next(&a->cursor);
        a->ring[i & (2 * V - 1)] = r;
        prefetch_lines(kc + r);
    }
    else if (a->next_left > 0) {  /* the range's own rows are all issued: the next range's first */
        const int64_t r = cursor_next(&a->next);
        prefetch_lines(a->nkc + r);
        prefetch_lines(a->nvc + r);
        a->next_left--;
    }
    if (i >= a->lag && i - a->lag < a->count) prefetch_lines(vc + a->ring[(i - a->lag) & (2 * V - 1)]);
}
/* Start the prefetch cursor at token t0 of [t0, t1) and issue its first PREFETCH_ROWS rows;
   `next` is the range to go on into, kbase/vbase the layer's K/V base (next->h is added). */
static inline void ahead_start(ahead_t* a, const plan_t* p, int64_t b, int64_t t0, int64_t t1,
                               const kv_t* kc, const kv_t* vc, const range_t* next, const kv_t* kbase,
                               const kv_t* vbase) {
    a->issued = 0;
    const int64_t next_len = next->t1 - next->t0;
    a->next_left = next_len <= 0 ? 0 : next_len < PREFETCH_ROWS ? next_len : PREFETCH_ROWS;
    if (a->next_left) {
        cursor_start(&a->next, p, next->b, next->t0);
        a->nkc = kbase + next->h * p->head_stride;
        a->nvc = vbase + next->h * p->head_stride;
    } else {  /* never read: set so -Wall's flow analysis sees no uninitialised use */
        a->next = (cursor_t){.p = p};
        a->nkc = a->nvc = kbase;
    }
    a->count = t1 - t0;
    a->lag = !p->tables && p->token_stride == HEAD_DIM ? 0 : V;
    cursor_start(&a->cursor, p, b, t0);
    while (a->issued < PREFETCH_ROWS && a->issued < a->count) prefetch_row(a, kc, vc);
}

/* A range's query rows as the scores read them: Q^T in pairs where the tile unit is on (amx set
   for this call), else vector rows. */
typedef struct {
    qrow_t row[GROUP];
#ifdef USE_AMX
    qpack_t pack __attribute__((aligned(64)));
    int amx;
#endif
} query_t;

static inline void score_rows_of(const kv_t* const* kr, const query_t* q, vf* sums, int64_t stride) {
#ifdef USE_AMX
    if (q->amx) { score_rows_amx(kr, q->pack, sums, stride); return; }
#endif
    (void)stride;
    score_rows(kr, q->row, sums);
}

/* The tile of n tokens at the cursor: its V rows and scores; one row prefetched per row. */
static inline void score_tile(tile_t* tl, cursor_t* cur, ahead_t* ahead, const kv_t* kc, const kv_t* vc,
                              int n, const query_t* q, float scale2) {
    const kv_t* kr[V];
    for (int i = 0; i < V; i++) {
        prefetch_row(ahead, kc, vc);
        const int64_t r = i < n ? cursor_next(cur) : -1;
        kr[i] = r < 0 ? zero_row : kc + r;
        tl->v[i] = r < 0 ? zero_row : vc + r;
    }
    score_rows_of(kr, q, tl->s, cur->p->token_stride);
    const vi valid = lane_ids() < splat((float)n);
    for (int g = 0; g < GROUP; g++) tl->s[g] = select_v(valid, tl->s[g] * scale2, splat(-1e30f));
}

#ifdef READ_ONLY
/* Built with -DREAD_ONLY (benchmarks only): the same work items, cursors and prefetches, with
   the arithmetic left out; every K and V row is loaded and summed as integers. Its time is the
   floor a layout's access pattern puts under the kernel on this machine, so a kernel's excess
   over the roofline splits into the pattern's cost and the compute it does not hide. */
static void attend_range(const plan_t* p, const kv_t* q, const kv_t* kc, const kv_t* vc, int64_t b, int64_t h,
                         int64_t t0, int64_t t1, float scale2, partial_t* st, const range_t* next, int amx) {
    const kv_t *kbase = kc, *vbase = vc;
    (void)q; (void)scale2; (void)amx;
    kc += h * p->head_stride;
    vc += h * p->head_stride;
    vu sum = {};
    cursor_t cur;
    ahead_t ahead;
    cursor_start(&cur, p, b, t0);
    ahead_start(&ahead, p, b, t0, t1, kc, vc, next, kbase, vbase);
    for (int64_t t = t0; t < t1; t++) {
        prefetch_row(&ahead, kc, vc);
        const int64_t r = cursor_next(&cur);
        for (size_t c = 0; c < HEAD_DIM * sizeof(kv_t); c += sizeof(vu)) {
            vu k, v;
            memcpy(&k, (const char*)(kc + r) + c, sizeof k);
            memcpy(&v, (const char*)(vc + r) + c, sizeof v);
            sum += k ^ v;
        }
    }
    const vf total = __builtin_convertvector(sum & 0xffffu, vf);
    for (int g = 0; g < GROUP; g++) {
        st->m[g] = 0.f;
        st->l[g] = 1.f;
        for (int d = 0; d < HEAD_DIM; d++) st->acc[g][d] = total[d % V];
    }
}
#else
/* Tokens [t0, t1) of sequence b for KV head h: unnormalised softmax state into *st.
   Software pipelined: the next tile's scores are computed between this tile's softmax and its
   P V, so the softmax's dependency chain (reduction, max, exp) overlaps independent work; a
   tile (~500 instructions) is wider than the reorder window, so without this the chain
   stalled every tile (12.7 -> 11.1 ns per token and KV head, bf16, measured). */
static void attend_range(const plan_t* p, const kv_t* q, const kv_t* kc, const kv_t* vc, int64_t b, int64_t h,
                         int64_t t0, int64_t t1, float scale2, partial_t* st, const range_t* next, int amx) {
    const kv_t *kbase = kc, *vbase = vc;
    kc += h * p->head_stride;
    vc += h * p->head_stride;
    q += h * GROUP * HEAD_DIM;
    query_t qr;
#ifdef USE_AMX
    if ((qr.amx = amx)) pack_q(q, qr.pack);
    else
#else
    (void)amx;
#endif
    for (int g = 0; g < GROUP; g++) load_q(q + g * HEAD_DIM, qr.row[g]);
    vf acc[GROUP][NC], lsum[GROUP];
    float m[GROUP];
    for (int g = 0; g < GROUP; g++) {
        for (int c = 0; c < NC; c++) acc[g][c] = splat(0.f);
        lsum[g] = splat(0.f);
        m[g] = -1e30f;
    }
    cursor_t cur;
    ahead_t ahead;
    cursor_start(&cur, p, b, t0);
    ahead_start(&ahead, p, b, t0, t1, kc, vc, next, kbase, vbase);
    tile_t tiles[2];
    score_tile(&tiles[0], &cur, &ahead, kc, vc, tile_len(t0, t1), &qr, scale2);
    for (int64_t t = t0, k = 0; t < t1; t += V, k ^= 1) {
        const int n = tile_len(t, t1);
        const tile_t* tl = &tiles[k];
        weights_t w[GROUP];
        for (int g = 0; g < GROUP; g++) {
            const float mx = hmax(tl->s[g]);  /* a new maximum rescales the state (no fmaxf: a libm call) */
            if (mx > m[g]) {
                const float corr = exp2f(m[g] - mx);
                for (int c = 0; c < NC; c++) acc[g][c] *= corr;
                lsum[g] *= corr;
                m[g] = mx;
            }
            const vf pr = exp2_tile(tl->s[g] - m[g]);
            lsum[g] += pr;
            to_weights(pr, &w[g]);
        }
        if (t + V < t1) score_tile(&tiles[k ^ 1], &cur, &ahead, kc, vc, tile_len(t + V, t1), &qr, scale2);
#ifdef USE_AMX
        if (qr.amx) accumulate_pv_amx(acc, tl, w, p->token_stride);
        else
#endif
        accumulate_pv(acc, tl, n, w);
    }
    for (int g = 0; g < GROUP; g++) {
        st->m[g] = m[g];
        st->l[g] = hsum(lsum[g]);
#ifdef USE_AMX
        if (qr.amx) store_acc_amx(st->acc[g], acc[g]);
        else
#endif
        store_acc(st->acc[g], acc[g]);
    }
}

#endif

/* A chunk of a dense context whose heads share each token's row: the K and V bytes of all its
   heads, read head after head while they stay in L2. At batch 64 on a 2-core AMX Xeon (K/V
   from memory, bench_kernels' caches, both builds in one process, 7-9 interleaved rounds) a
   pass per head over the whole context took, against 192 KiB-1 MiB chunks, 1/0.92-0.95 the
   time at 2,048 tokens layer-packed and 1/0.95-0.96 token-major; level at 320 tokens and at
   batch 1 (its pieces are shorter than a chunk). Paged blocks were level (1/0.99-1.02): not
   chunked. Prefetching the other heads' lines into L2 during head 0's pass, with or without
   chunks, was slower (1.01-1.09x). On the Zen 4 EPYC with L2 prefetches (above), no chunks,
   64 KiB and 1 MiB chunks measured within 5% of these, layer-packed and token-major; paged
   blocks chunked there were level too (2,048 tokens: scattered 5.17 against 5.34 ms a layer,
   in runs 4.43 against 4.16; 64 KiB chunks 1.13-1.15x slower). */
#define CHUNK_BYTES (256 << 10)
/* Fold a later range's softmax state into an earlier one's (element-wise, so in any
   accumulator order). */
static void merge_state(partial_t* into, const partial_t* add) {
    for (int g = 0; g < GROUP; g++) {
        const float mx = fmaxf(into->m[g], add->m[g]);
        const float a = exp2f(into->m[g] - mx), w = exp2f(add->m[g] - mx);
        into->m[g] = mx;
        into->l[g] = a * into->l[g] + w * add->l[g];
        for (int d = 0; d < HEAD_DIM; d++) into->acc[g][d] = a * into->acc[g][d] + w * add->acc[g][d];
    }
}

/* Attention of every sequence's query row over its context, for one layer.
   q/out: [T, num_kv_heads * GROUP, HEAD_DIM] contiguous; kc/vc: the layer's K/V base;
   k_new/v_new (or NULL): [T, num_kv_heads, HEAD_DIM] contiguous, the step's new tokens.
   Work items are (sequence, context piece), each running its KV heads one after another on
   one thread (per chunk where a token's heads share its row, CHUNK_BYTES): one K and one V
   stream at a time, and the heads' rows of a token, which share pages and DRAM rows
   (layer-packed: one 4 KiB page per token; token-major and paged: adjacent lines), are read
   by one core. Items of (sequence, KV head, piece) spread a token's heads
   over both cores of a 2-core Xeon: at batch 64 this order took 1.03-1.06 against 1.19-1.21 ms
   per layer at 320 tokens token-major, 1.25-1.27 against 1.43-1.45 layer-packed, 1.06-1.08
   against 1.26 paged in runs (2,048 tokens: 6.3-6.6 / 7.0-7.2, 9.3 / 9.8-10.1, 6.4 / 7.1-7.3;
   head-major level; batch 1 and 8 better or level; bench_kernels.py). (Items of all heads of
   a token in one pass, vectorised across heads, were 1.5x slower on token-major and paged
   K/V.) Contexts are split only when sequences are too few to keep every thread busy, and the
   pieces' states are then combined. */
int decode_attention(const plan_t* p, const kv_t* q, kv_t* kc, kv_t* vc, kv_t* out, float scale,
                     int num_threads, const kv_t* k_new, const kv_t* v_new) {
    const int64_t hkv = p->num_kv_heads, q_row = hkv * GROUP * HEAD_DIM;
    if (k_new)  /* append each sequence's new token (its last) from k_new/v_new rows first */
        for (int64_t b = 0; b < p->num_seqs; b++) {
            cursor_t cur;
            cursor_start(&cur, p, b, p->lens[b] - 1);
            const int64_t off = cursor_next(&cur), src = p->rows[b] * hkv * HEAD_DIM;
            for (int64_t h = 0; h < hkv; h++) {
                memcpy(kc + off + h * p->head_stride, k_new + src + h * HEAD_DIM, HEAD_DIM * sizeof(kv_t));
                memcpy(vc + off + h * p->head_stride, v_new + src + h * HEAD_DIM, HEAD_DIM * sizeof(kv_t));
            }
        }
    const float scale2 = scale * 1.44269504089f;  /* softmax in base 2 */
    int64_t total = 0;
    for (int64_t b = 0; b < p->num_seqs; b++) total += p->lens[b];
    /* Below 512 (token, head) pairs the work is a few microseconds: one thread. Above, threads
       pay even at batch 1: in a step each layer's K/V comes from memory, not cache (the layers
       between evict it), and with K/V evicted before each call, on a 2-core AVX2 EPYC, the
       former cut at 4,096 pairs cost (batch x context) 1 x 1,000: 145 against 102 us,
       2 x 300: 109 / 84, 4 x 64: 80 / 66, 8 x 32: 92 / 75; batch 1 at 64-300 tokens: level. */
    if (total * hkv < 512) num_threads = 1;
    int64_t split = INT64_MAX;
    if (num_threads > 1 && p->num_seqs < 4 * num_threads) {
        split = (total + 4 * num_threads - 1) / (4 * num_threads);
        split = split < p->min_split ? p->min_split : (split + V - 1) / V * V;
    }
    /* Heads interleaved in a token's row (token-major, layer-packed): pass over the context in
       chunks of CHUNK_BYTES, every head per chunk, so heads 1.. read their lines from L2. */
    int64_t chunk = !p->tables && p->head_stride == HEAD_DIM && hkv > 1
        ? CHUNK_BYTES / (2 * hkv * HEAD_DIM * (int64_t)sizeof(kv_t)) : INT64_MAX;
    if (chunk < INT64_MAX) chunk = chunk < V ? V : chunk / V * V;
    int64_t* first = malloc((p->num_seqs + 1) * sizeof(int64_t));  /* first piece of each sequence */
    if (!first) return -1;
    first[0] = 0;
    for (int64_t b = 0; b < p->num_seqs; b++)
        first[b + 1] = first[b] + (split == INT64_MAX ? 1 : (p->lens[b] + split - 1) / split);
    const int64_t pieces = first[p->num_seqs];
    if (num_threads > pieces) num_threads = pieces > 1 ? (int)pieces : 1;  /* no idle thread */
    partial_t* scratch = NULL;  /* [pieces, hkv] states when contexts are split */
    if (pieces > p->num_seqs && !(scratch = malloc(pieces * hkv * sizeof(partial_t)))) {
        free(first);
        return -1;
    }
#ifdef USE_AMX
    const int amx = amx_usable();
    tilecfg_t cfg;
    amx_config(&cfg);
#else
    const int amx = 0;
#endif
    #pragma omp parallel num_threads(num_threads) if(num_threads > 1)
    {
#ifdef USE_AMX
        /* Tile state is per thread, and torch's own AMX kernels may have theirs loaded on this
           one: keep it, and load it back at the end (tile data is never kept between calls). */
        tilecfg_t saved;
        if (amx) { _tile_storeconfig(&saved); _tile_loadconfig(&cfg); }
#endif
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < pieces; it++) {
            int64_t lo = 0, hi = p->num_seqs;  /* the sequence holding piece it */
            while (hi - lo > 1) {
                const int64_t mid = (lo + hi) / 2;
                if (first[mid] <= it) lo = mid; else hi = mid;
            }
            const int64_t b = lo, s = it - first[b], len = p->lens[b];
            const int64_t t0 = scratch ? s * split : 0, t1 = scratch && t0 + split < len ? t0 + split : len;
            partial_t own[hkv];
            partial_t* st = scratch ? scratch + it * hkv : own;
            for (int64_t c0 = t0, c1; c0 < t1; c0 = c1) {
                c1 = t1 - c0 > chunk ? c0 + chunk : t1;
                for (int64_t h = 0; h < hkv; h++) {  /* one thread: a token's heads share lines and pages */
                    partial_t part;
                    partial_t* into = c0 == t0 ? st + h : &part;
                    range_t next = {b, h + 1, c0, c1};
                    if (h + 1 == hkv) next = (range_t){b, 0, c1, t1 - c1 > chunk ? c1 + chunk : t1};
                    attend_range(p, q + p->rows[b] * q_row, kc, vc, b, h, c0, c1, scale2, into, &next, amx);
                    if (c0 != t0) merge_state(st + h, &part);
                }
            }
            if (!scratch)
                for (int64_t h = 0; h < hkv; h++)
                    write_out(out + p->rows[b] * q_row + h * GROUP * HEAD_DIM, st + h);
        }
        if (scratch) {
            #pragma omp for schedule(dynamic, 1)
            for (int64_t bh = 0; bh < p->num_seqs * hkv; bh++) {  /* combine the pieces */
                const int64_t b = bh / hkv, h = bh % hkv;
                partial_t st = scratch[first[b] * hkv + h];
                for (int64_t s = first[b] + 1; s < first[b + 1]; s++) merge_state(&st, &scratch[s * hkv + h]);
                write_out(out + p->rows[b] * q_row + h * GROUP * HEAD_DIM, &st);
            }
        }
#ifdef USE_AMX
        if (amx) {
            if (saved.palette) _tile_loadconfig(&saved);
            else _tile_release();
        }
#endif
    }
    free(scratch);
    free(first);
    return 0;
}
"""
SOURCE = SOURCE.replace("EXP2_PS\n", EXP2_PS.lstrip("\n")).replace("VECTOR_EXP2\n", VECTOR_EXP2)
