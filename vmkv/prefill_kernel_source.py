"""C source of the CPU prefill-attention kernel (built by vmkv/prefill_kernel.py).

One sequence's new rows attend causally over its context: query row i (of n) sits at
position L - n + i and sees keys 0..L - n + i, so a chunk after cached tokens and a whole
new prompt are the same call. K and V are read in place from any [L, Hkv, D] views (token and
head strides of their own, last dim contiguous): a vattention slot (any order), a contiguous
slot or the concatenation a paged prefill builds.

Why a kernel of our own: torch's CPU flash attention ran a 1,000-token causal bf16 prompt of
the default model (9 query / 3 KV heads, head_dim 64) at ~96 GFLOP/s on an AVX512-BF16 EPYC
(12 ms per layer, a third of the whole prefill) and at ~370 GFLOP/s on AMX tiles (3.1 ms).
The design:
- per KV head, K is repacked once per call into blocks of 64 keys laid out [dim pair][key]
  (each 32-bit word one key's two bf16 dims), V into [key pair][dim] (each word two keys'
  values of one dim). Those are exactly the B operands of both products on the AMX tile unit
  (16 rows of 64 bytes: K^T for Q K^T, V for P V), and on `vdpbf16ps` they make both products
  broadcast-one-word, multiply-a-vector loops with no horizontal sums;
- one work item is (KV head, 16 query positions): its G query heads x 16 rows share every
  K/V block it reads (GQA), walked up to the causal limit of its last row;
- softmax is online in fp32 in log2 units (scores scaled by scale * log2(e) once, 2^x by the
  decode kernel's polynomial), for 16 rows at a time: their maxima come out of one shuffle
  tree as a vector, so the rescale factors are one vector exp2 and no row waits on its own
  reduction; masked keys are exactly zero, P is rounded to bf16 for P V as torch's bf16 flash
  attention does, the output is the fp32 sum divided by the row's sum, rounded to nearest
  even once;
- with AMX (`tiles`), Q K^T of 16 rows against 64 or 128 keys and P V are tile products (the
  vector unit does the softmax between them), without it `vdpbf16ps` register blocks.
Items go to OpenMP threads dynamically, longest (last rows) first.
"""

from vmkv.decode_kernel_source import EXP2_PS

SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define TILES 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if !defined(__AVX512BF16__) || !defined(__AVX512BW__)
#error "the prefill kernel needs AVX512-BF16"
#endif
#if HEAD_DIM % 32
#error "HEAD_DIM must be a multiple of 32"
#endif

#define D2 (HEAD_DIM / 2)       /* 32-bit words (bf16 pairs) per row */
#define DZ (HEAD_DIM / 16)      /* fp32 vectors per output row */
#define KB 64                   /* keys per block */
#define KT (2 * KB)             /* keys per pass of the tile path */
#define QB 16                   /* query positions per work item */
#define MR 4                    /* query rows per Q K^T register block */
#define PR (DZ <= 4 ? 4 : 2)    /* query rows per P V register block */
#define ROWS (QB * GROUP)
#define ROWS_T ((ROWS + 15) / 16 * 16) /* rows in whole tiles: what the buffers hold */

EXP2_PS
/* Block b (keys b * KB ..) of one head's K -> kb_out [D2][KB] words; keys past L are zero. */
static void pack_k(const uint32_t* k, int64_t tok, int64_t L, int64_t b, uint32_t* kb_out) {
    for (int64_t j = 0; j < KB; j++) {
        const int64_t t = b * KB + j;
        if (t + 8 < L) /* the rows a few keys on: their lines arrive while these are copied */
            for (int d = 0; d < D2; d += 16) _mm_prefetch((const char*)(k + (t + 8) * tok + d), _MM_HINT_T0);
        for (int d = 0; d < D2; d++) kb_out[d * KB + j] = t < L ? k[t * tok + d] : 0;
    }
}

/* Block b of one head's V -> vb_out [KB / 2][HEAD_DIM] words: (V[2p][d], V[2p + 1][d]) in bf16 units. */
static void pack_v(const uint16_t* v, int64_t tok, int64_t L, int64_t b, uint16_t* vb_out) {
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t p = 0; p < KB / 2; p++) {
        const int64_t t = b * KB + 2 * p;
        for (int d = 0; d < HEAD_DIM; d += 32) {
            const __m512i x = t < L ? _mm512_loadu_si512(v + t * tok + d) : zero;
            const __m512i y = t + 1 < L ? _mm512_loadu_si512(v + (t + 1) * tok + d) : zero;
            uint16_t* dst = vb_out + 2 * p * HEAD_DIM + 2 * d;
            _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(x, lo, y));
            _mm512_storeu_si512(dst + 32, _mm512_permutex2var_epi16(x, hi, y));
        }
    }
}

typedef struct {  /* what every item reads; K and V are read from their packed copies */
    const uint16_t* q;
    uint16_t* out;
    int64_t q_tok, q_head, out_tok, out_head;
    int64_t n, L;
    float scale;
} args_t;

typedef struct {  /* one thread's buffers, ROWS_T rows each */
    uint32_t* q;  /* the item's query rows, [row][D2] words (bf16 pairs) */
    uint16_t* p;  /* a block's P, [row][KB] bf16 ([row][KT] on the tile path) */
    float* o;     /* output sums, [row][HEAD_DIM] */
    float* s;     /* tile path: a row tile's scores [16][KT], then its P V [16][HEAD_DIM] */
} buffers_t;

typedef struct {  /* one item's rows: r = (query position - i0) * GROUP + g */
    int64_t rows;  /* real rows; the rest, up to the buffers' padding, are zero */
    int64_t limit[ROWS_T];  /* a row's last visible key; -1 for padding rows */
    float m[ROWS_T], alpha[ROWS_T];  /* running max (log2 units); the block's rescale */
    __m512 l[ROWS_T];  /* running sum, in 16 partial sums */
} rows_t;

/* Query rows of KV head h, positions [i0, i1), into b->q; limits and running softmax reset. */
static void start_item(const args_t* a, int64_t h, int64_t i0, int64_t i1, const buffers_t* b, rows_t* r) {
    const int64_t offset = a->L - a->n;
    r->rows = (i1 - i0) * GROUP;
    memset(b->q, 0, sizeof(uint32_t) * ROWS_T * D2);
    memset(b->o, 0, sizeof(float) * ROWS_T * HEAD_DIM);
    for (int64_t row = 0; row < ROWS_T; row++) {
        const int64_t i = i0 + row / GROUP, g = row % GROUP;
        if (row < r->rows)
            memcpy(b->q + row * D2, a->q + i * a->q_tok + (h * GROUP + g) * a->q_head, HEAD_DIM * 2);
        r->limit[row] = row < r->rows ? offset + i : -1;
        r->m[row] = -INFINITY;
        r->l[row] = _mm512_setzero_ps();
    }
}

/* Lane m of the result: the largest lane of v[m]. A tree of 128-, then 32-bit lane shuffles
   leaves row 4i + k in lane 4k + i; one permutation puts it in order. */
static inline __m512 max_of_rows(const __m512 v[16]) {
    __m512 w[8], x[4], y[2];
    for (int i = 0; i < 8; i++) /* lanes 0-7: row 2i, 8-15: row 2i + 1 */
        w[i] = _mm512_max_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xee));
    for (int j = 0; j < 4; j++) /* 128-bit block k: row 4j + k */
        x[j] = _mm512_max_ps(_mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0xdd));
    for (int j = 0; j < 2; j++) /* block k: rows 8j + k (lanes 0-1), 8j + 4 + k (lanes 2-3) */
        y[j] = _mm512_max_ps(_mm512_shuffle_ps(x[2 * j], x[2 * j + 1], 0x44),
                             _mm512_shuffle_ps(x[2 * j], x[2 * j + 1], 0xee));
    const __m512 z = _mm512_max_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xdd));
    return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), z);
}

/* Online softmax of 16 rows (from row0) of raw scores s ([16][16 * nv], keys kb ..) into P
   (bf16, the same shape): keys past a row's limit are exactly zero (s keeps -inf there); the
   running max and sum move on, alpha takes the rescale of the rows' earlier output sums.
   Across rows in vectors (the maxima, the rescale), so no row waits on its own reduction. */
static inline void softmax_rows(float* s, const int nv, int64_t row0, int64_t kb, __m512 scale, rows_t* r,
                                uint16_t* p) {
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
    __m512 mx[16];
    for (int m = 0; m < 16; m++) {
        const int64_t last = r->limit[row0 + m] - kb; /* key kb + j is visible iff j <= last */
        mx[m] = minus_inf;
        for (int z = 0; z < nv; z++) {
            const int64_t seen = last - 16 * z + 1; /* keys of this vector the row sees */
            const __mmask16 keep = seen >= 16 ? 0xffff : seen <= 0 ? 0 : (__mmask16)((1u << seen) - 1);
            float* sz = s + (m * nv + z) * 16;
            const __m512 x = _mm512_mask_mul_ps(minus_inf, keep, _mm512_load_ps(sz), scale);
            _mm512_store_ps(sz, x);
            mx[m] = _mm512_max_ps(mx[m], x);
        }
    }
    const __m512 m_old = _mm512_loadu_ps(r->m + row0);
    const __m512 m_new = _mm512_max_ps(m_old, max_of_rows(mx));
    const __mmask16 seen = _mm512_cmp_ps_mask(m_new, minus_inf, _CMP_NEQ_OQ); /* rows with a visible key */
    /* m_old is -inf until a row sees a key: clamped, its rescale is 2^-127 (of sums still 0) */
    const __m512 shift = _mm512_max_ps(_mm512_sub_ps(m_old, m_new), _mm512_set1_ps(-127.0f));
    const __m512 alpha = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), seen, exp2_ps(shift));
    _mm512_storeu_ps(r->m + row0, m_new);
    _mm512_storeu_ps(r->alpha + row0, alpha);
    for (int m = 0; m < 16; m++) {
        uint16_t* pm = p + m * nv * 16;
        if (!(seen >> m & 1)) { /* padding row, or no visible key yet */
            memset(pm, 0, 32 * nv);
            continue;
        }
        const __m512 mv = _mm512_set1_ps(r->m[row0 + m]);
        __m512 sum = _mm512_setzero_ps();
        for (int z = 0; z < nv; z++) {
            const __m512 x = _mm512_load_ps(s + (m * nv + z) * 16);
            const __mmask16 keep = _mm512_cmp_ps_mask(x, minus_inf, _CMP_NEQ_OQ);
            const __m256bh pb = _mm512_cvtneps_pbh(_mm512_maskz_mov_ps(keep, exp2_ps(_mm512_sub_ps(x, mv))));
            sum = _mm512_add_ps(sum, _mm512_cvtpbh_ps(pb)); /* the sum of what P V multiplies */
            _mm256_storeu_si256((__m256i*)(pm + 16 * z), (__m256i)pb);
        }
        /* a row's sum stays a vector of 16 partial sums until the item ends */
        r->l[row0 + m] = _mm512_fmadd_ps(r->l[row0 + m], _mm512_set1_ps(r->alpha[row0 + m]), sum);
    }
}

/* The item's output rows: sums over the row's softmax sum, rounded to bf16 once. */
static void finish_item(const args_t* a, int64_t h, int64_t i0, const buffers_t* b, const rows_t* r) {
    for (int64_t row = 0; row < r->rows; row++) {
        const int64_t i = i0 + row / GROUP, g = row % GROUP;
        uint16_t* dst = a->out + i * a->out_tok + (h * GROUP + g) * a->out_head;
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(r->l[row]));
        for (int z = 0; z < DZ; z++) { /* rounded to nearest even, NaN stays NaN */
            const __m512 o = _mm512_mul_ps(_mm512_load_ps(b->o + row * HEAD_DIM + 16 * z), inv);
            _mm256_storeu_si256((__m256i*)(dst + 16 * z), (__m256i)_mm512_cvtneps_pbh(o));
        }
    }
}

/* One item on vdpbf16ps: KV head h, query positions [i0, i1). */
static void attend_item(const args_t* a, const uint32_t* kp, const uint32_t* vp, int64_t h, int64_t i0,
                        int64_t i1, const buffers_t* b, rows_t* r) {
    start_item(a, h, i0, i1, b, r);
    const int64_t rows_pad = (r->rows + 15) / 16 * 16;
    const int64_t kend = a->L - a->n + i1; /* keys [0, kend) */
    const __m512 scale = _mm512_set1_ps(a->scale * 1.44269504f); /* log2 units */
    for (int64_t kb = 0; kb < kend; kb += KB) {
        const uint32_t* kblk = kp + (kb / KB) * D2 * KB;
        for (int64_t t = 0; t < rows_pad; t += 16) {
            for (int64_t r0 = t; r0 < t + 16; r0 += MR) {
                __m512 s[MR][4];
                for (int m = 0; m < MR; m++)
                    for (int z = 0; z < 4; z++) s[m][z] = _mm512_setzero_ps();
                for (int d = 0; d < D2; d++) {
                    const uint32_t* kd = kblk + d * KB;
                    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kd);
                    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kd + 16);
                    const __m512bh k2 = (__m512bh)_mm512_loadu_si512(kd + 32);
                    const __m512bh k3 = (__m512bh)_mm512_loadu_si512(kd + 48);
                    for (int m = 0; m < MR; m++) {
                        const __m512bh qv = (__m512bh)_mm512_set1_epi32((int)b->q[(r0 + m) * D2 + d]);
                        s[m][0] = _mm512_dpbf16_ps(s[m][0], qv, k0);
                        s[m][1] = _mm512_dpbf16_ps(s[m][1], qv, k1);
                        s[m][2] = _mm512_dpbf16_ps(s[m][2], qv, k2);
                        s[m][3] = _mm512_dpbf16_ps(s[m][3], qv, k3);
                    }
                }
                for (int m = 0; m < MR; m++)
                    for (int z = 0; z < 4; z++) _mm512_store_ps(b->s + ((r0 - t + m) * 4 + z) * 16, s[m][z]);
            }
            softmax_rows(b->s, KB / 16, t, kb, scale, r, b->p + t * KB);
        }
        const int64_t pairs = ((kend - kb < KB ? kend - kb : KB) + 1) / 2;
        const uint32_t* vblk = vp + (kb / 2) * HEAD_DIM;
        for (int64_t r0 = 0; r0 < rows_pad; r0 += PR) {
            __m512 o[PR][DZ];
            for (int m = 0; m < PR; m++) {
                const __m512 al = _mm512_set1_ps(r->alpha[r0 + m]);
                for (int z = 0; z < DZ; z++)
                    o[m][z] = _mm512_mul_ps(_mm512_loadu_ps(b->o + (r0 + m) * HEAD_DIM + 16 * z), al);
            }
            for (int64_t p = 0; p < pairs; p++) {
                __m512bh vv[DZ];
                for (int z = 0; z < DZ; z++)
                    vv[z] = (__m512bh)_mm512_loadu_si512(vblk + p * HEAD_DIM + 16 * z);
                for (int m = 0; m < PR; m++) {
                    uint32_t word;
                    memcpy(&word, b->p + (r0 + m) * KB + 2 * p, 4);
                    const __m512bh pv = (__m512bh)_mm512_set1_epi32((int)word);
                    for (int z = 0; z < DZ; z++) o[m][z] = _mm512_dpbf16_ps(o[m][z], pv, vv[z]);
                }
            }
            for (int m = 0; m < PR; m++)
                for (int z = 0; z < DZ; z++) _mm512_storeu_ps(b->o + (r0 + m) * HEAD_DIM + 16 * z, o[m][z]);
        }
    }
    finish_item(a, h, i0, b, r);
}

#ifdef TILES
/* The same item on the AMX tile unit: the packed K block ([D2][KB] words) and V block
   ([KB / 2][HEAD_DIM] words) are tile products' B operands as they lie, the query rows and P
   (row-major bf16) their A operands. Tiles 0-3: fp32 results (16 rows x 16 columns); 4: A;
   5-7: B. Scores and P V go through memory (b->s) for the softmax and the rescale in AVX-512. */

/* The OS hands out AMX state only on request (Linux: arch_prctl, once per process). */
static int tiles_granted(void) {
    static int granted = -1;
    if (granted < 0) granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0;
    return granted;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config_t;

static void load_tile_config(void) {  /* every tile 16 rows x 64 bytes */
    tile_config_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* Scores of 16 query rows against one K block: s[16 rows][KB] (rows `keys` apart). */
static inline void scores_tile(const uint32_t* q, const uint32_t* kblk, float* s, int keys) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int d = 0; d < D2; d += 16) { /* 32 dims a step: 16 rows of the K block */
        _tile_loadd(4, q + d, D2 * 4);
        _tile_loadd(5, kblk + d * KB, KB * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, kblk + d * KB + 16, KB * 4);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, kblk + d * KB + 32, KB * 4);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, kblk + d * KB + 48, KB * 4);
        _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, s, keys * 4);
    _tile_stored(1, s + 16, keys * 4);
    _tile_stored(2, s + 32, keys * 4);
    _tile_stored(3, s + 48, keys * 4);
}

/* P (16 rows of [keys] bf16) times those keys' V into pv[16][HEAD_DIM] fp32. */
static inline void values_tile(const uint16_t* p, const uint32_t* vblk, float* pv, int keys) {
    for (int c = 0; c < HEAD_DIM / 16; c += 4) { /* 64 dims (4 result tiles) a pass */
        _tile_zero(0); _tile_zero(1);
        if (c + 2 < HEAD_DIM / 16) { _tile_zero(2); _tile_zero(3); }
        for (int u = 0; u < keys / 2; u += 16) { /* 32 keys a step: 16 rows of key pairs */
            _tile_loadd(4, p + 2 * u, keys * 2);
            const uint32_t* vu = vblk + u * HEAD_DIM + 16 * c;
            _tile_loadd(5, vu, HEAD_DIM * 4);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, vu + 16, HEAD_DIM * 4);
            _tile_dpbf16ps(1, 4, 6);
            if (c + 2 < HEAD_DIM / 16) {
                _tile_loadd(7, vu + 32, HEAD_DIM * 4);
                _tile_dpbf16ps(2, 4, 7);
                _tile_loadd(5, vu + 48, HEAD_DIM * 4);
                _tile_dpbf16ps(3, 4, 5);
            }
        }
        _tile_stored(0, pv + 16 * c, HEAD_DIM * 4);
        _tile_stored(1, pv + 16 * c + 16, HEAD_DIM * 4);
        if (c + 2 < HEAD_DIM / 16) {
            _tile_stored(2, pv + 16 * c + 32, HEAD_DIM * 4);
            _tile_stored(3, pv + 16 * c + 48, HEAD_DIM * 4);
        }
    }
}

static void attend_item_tiles(const args_t* a, const uint32_t* kp, const uint32_t* vp, int64_t h, int64_t i0,
                              int64_t i1, const buffers_t* b, rows_t* r) {
    start_item(a, h, i0, i1, b, r);
    const int64_t row_tiles = (r->rows + 15) / 16;
    const int64_t kend = a->L - a->n + i1; /* keys [0, kend) */
    const __m512 scale = _mm512_set1_ps(a->scale * 1.44269504f); /* log2 units */
    for (int64_t kb = 0; kb < kend; kb += KT) { /* up to two K blocks a pass */
        const int keys = kend - kb > KB ? KT : KB;
        const uint32_t* kblk = kp + (kb / KB) * D2 * KB;
        const uint32_t* vblk = vp + (kb / 2) * HEAD_DIM;
        for (int64_t t = 0; t < row_tiles; t++) {
            scores_tile(b->q + 16 * t * D2, kblk, b->s, keys);
            if (keys > KB) scores_tile(b->q + 16 * t * D2, kblk + D2 * KB, b->s + KB, keys);
            softmax_rows(b->s, keys / 16, 16 * t, kb, scale, r, b->p + 16 * t * KT);
            values_tile(b->p + 16 * t * KT, vblk, b->s, keys);
            for (int m = 0; m < 16; m++) {
                float* o = b->o + (16 * t + m) * HEAD_DIM;
                const __m512 al = _mm512_set1_ps(r->alpha[16 * t + m]);
                const float* pv = b->s + m * HEAD_DIM;
                for (int z = 0; z < DZ; z++)
                    _mm512_store_ps(o + 16 * z, _mm512_fmadd_ps(_mm512_load_ps(o + 16 * z), al,
                                                                _mm512_load_ps(pv + 16 * z)));
            }
        }
    }
    finish_item(a, h, i0, b, r);
}
#endif

/* out[i, h * GROUP + g] = softmax(scale * q[i, h * GROUP + g] . K[0 .. L - n + i]) V, for
   i < n, every KV head h < hkv. Strides in elements. tiles: run on the AMX tile unit where this
   build and the OS allow it. Returns nonzero if memory ran out. */
int prefill_attention(const uint16_t* q, int64_t q_tok, int64_t q_head, const uint16_t* k, int64_t k_tok,
                      int64_t k_head, const uint16_t* v, int64_t v_tok, int64_t v_head, uint16_t* out,
                      int64_t out_tok, int64_t out_head,
                      int64_t n, int64_t L, int64_t hkv, float scale, int num_threads, int tiles) {
    const args_t a = {q, out, q_tok, q_head, out_tok, out_head, n, L, scale};
    const int64_t blocks = (L + KB - 1) / KB, head_words = blocks * KB * D2;
#ifdef TILES
    tiles = tiles && tiles_granted();
#else
    (void)tiles; /* a build without the tile unit */
#endif
    uint32_t* kp = aligned_alloc(64, (size_t)(2 * hkv * head_words) * 4);
    if (!kp) return 1;
    uint32_t* vp = kp + hkv * head_words;
    const int64_t qblocks = (n + QB - 1) / QB, items = hkv * qblocks;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads) if(num_threads > 1)
    {
        #pragma omp for schedule(static)
        for (int64_t hb = 0; hb < hkv * blocks; hb++) { /* (head, block): even shares for any hkv */
            const int64_t h = hb / blocks, b = hb % blocks, at = h * head_words + b * KB * D2;
            pack_k((const uint32_t*)(k + h * k_head), k_tok / 2, L, b, kp + at);
            pack_v(v + h * v_head, v_tok, L, b, (uint16_t*)(vp + at));
        }
        const buffers_t b = {
            aligned_alloc(64, sizeof(uint32_t) * ROWS_T * D2),
            aligned_alloc(64, 2 * ROWS_T * KT),
            aligned_alloc(64, sizeof(float) * ROWS_T * HEAD_DIM),
            aligned_alloc(64, sizeof(float) * 16 * (KT > HEAD_DIM ? KT : HEAD_DIM)),
        };
        rows_t r;
        if (!b.q || !b.p || !b.o || !b.s) {
            #pragma omp atomic write
            failed = 1;
        }
#ifdef TILES
        tile_config_t saved; /* the thread's tile configuration (oneDNN's), restored after */
        if (tiles) {
            _tile_storeconfig(&saved);
            load_tile_config();
        }
#endif
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (failed) continue;
            const int64_t qb = qblocks - 1 - it / hkv, h = it % hkv; /* last rows see most keys: first */
            const int64_t i0 = qb * QB, i1 = i0 + QB < n ? i0 + QB : n;
#ifdef TILES
            if (tiles) {
                attend_item_tiles(&a, kp + h * head_words, vp + h * head_words, h, i0, i1, &b, &r);
                continue;
            }
#endif
            attend_item(&a, kp + h * head_words, vp + h * head_words, h, i0, i1, &b, &r);
        }
#ifdef TILES
        if (tiles) {
            if (saved.palette)
                _tile_loadconfig(&saved);
            else
                _tile_release();
        }
#endif
        free(b.q); free(b.p); free(b.o); free(b.s);
    }
    free(kp);
    return failed;
}
"""
SOURCE = SOURCE.replace("EXP2_PS\n", EXP2_PS.lstrip("\n"))
