"""C source of the CPU prefill-attention kernel (built by vmkv/prefill_kernel.py).

One sequence's new rows attend causally over its context: query row i (of n) sits at
position L - n + i and sees keys 0..L - n + i, so a chunk after cached tokens and a whole
new prompt are the same call. K and V are read in place from any [L, Hkv, D] views (token and
head strides of their own, last dim contiguous): a vattention slot (any order), a contiguous slot or the
concatenation a paged prefill builds.

Why a kernel of our own: torch's CPU flash attention ran a 1,000-token causal bf16 prompt of
the default model (9 query / 3 KV heads, head_dim 64) at ~96 GFLOP/s, 12 ms per layer, a
third of the whole prefill. This kernel is a flash-attention loop on AVX512-BF16's
`vdpbf16ps`, which multiplies bf16 pairs into fp32 sums:
- per KV head, K is repacked once per call into blocks of 64 keys laid out
  [dim pair][key] (each 32-bit word one key's two bf16 dims), V into [key pair][dim]
  (each word two keys' values of one dim): then Q K^T and P V are both broadcast-one-word,
  multiply-a-vector loops, with no horizontal sums;
- one work item is (KV head, 16 query positions): its G query heads x 16 rows share every
  K/V block it reads (GQA), walked up to the causal limit of its last row;
- softmax is online per row in fp32 (scores scaled in fp32, masked keys exactly zero),
  P is rounded to bf16 for P V as torch's bf16 flash attention does, the output is the
  fp32 sum divided by the row's sum, rounded to nearest even once.
Items go to OpenMP threads dynamically, longest (last rows) first.
"""

SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__AVX512BF16__) || !defined(__AVX512BW__)
#error "the prefill kernel needs AVX512-BF16"
#endif
#if HEAD_DIM % 32
#error "HEAD_DIM must be a multiple of 32"
#endif

#define D2 (HEAD_DIM / 2)       /* 32-bit words (bf16 pairs) per row */
#define DZ (HEAD_DIM / 16)      /* fp32 vectors per output row */
#define KB 64                   /* keys per block */
#define QB 16                   /* query positions per work item */
#define MR 4                    /* query rows per Q K^T register block */
#define PR (DZ <= 4 ? 4 : 2)    /* query rows per P V register block */
#define ROWS (QB * GROUP)
#define ROWS_PAD ((ROWS + MR - 1) / MR * MR)

/* exp(x) for x <= 0 (x - max): 2^n * p(r), r in [-ln2/2, ln2/2], degree-6 Taylor (rel. err ~1e-7). */
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-88.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static inline uint16_t to_bf16(float f) {  /* round to nearest even; NaN stays NaN */
    uint32_t u; memcpy(&u, &f, 4);
    if (f != f) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* K of one head, keys [0, L) -> kp [blocks][D2][KB] words; keys past L are zero. */
static void pack_k(const uint32_t* k, int64_t tok, int64_t L, int64_t blocks, uint32_t* kp) {
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t j = 0; j < KB; j++) {
            const int64_t t = b * KB + j;
            uint32_t* dst = kp + b * D2 * KB + j;
            if (t < L)
                for (int d = 0; d < D2; d++) dst[d * KB] = k[t * tok + d];
            else
                for (int d = 0; d < D2; d++) dst[d * KB] = 0;
        }
}

/* V of one head -> vp [blocks * KB / 2][HEAD_DIM] words: (V[2p][d], V[2p + 1][d]), vp in bf16 units. */
static void pack_v(const uint16_t* v, int64_t tok, int64_t L, int64_t blocks, uint16_t* vp) {
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t p = 0; p < blocks * KB / 2; p++) {
        const int64_t t = 2 * p;
        for (int d = 0; d < HEAD_DIM; d += 32) {
            const __m512i a = t < L ? _mm512_loadu_si512(v + t * tok + d) : zero;
            const __m512i b = t + 1 < L ? _mm512_loadu_si512(v + (t + 1) * tok + d) : zero;
            _mm512_storeu_si512(vp + (2 * p * HEAD_DIM + 2 * d), _mm512_permutex2var_epi16(a, lo, b));
            _mm512_storeu_si512(vp + (2 * p * HEAD_DIM + 2 * d + 32), _mm512_permutex2var_epi16(a, hi, b));
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

/* One item: KV head h, query positions [i0, i1). */
static void attend_item(const args_t* a, const uint32_t* kp, const uint32_t* vp, int64_t h, int64_t i0,
                        int64_t i1, uint32_t* qbuf, uint16_t* pbuf, float* obuf) {
    const int64_t offset = a->L - a->n, rows = (i1 - i0) * GROUP;
    const int64_t rows_pad = (rows + MR - 1) / MR * MR;
    float m_run[ROWS_PAD], l_run[ROWS_PAD], alpha[ROWS_PAD];
    int64_t limit[ROWS_PAD];
    memset(qbuf, 0, sizeof(uint32_t) * ROWS_PAD * D2);
    for (int64_t r = 0; r < rows_pad; r++) {
        const int64_t i = i0 + r / GROUP, g = r % GROUP;
        if (r < rows)
            memcpy(qbuf + r * D2, a->q + i * a->q_tok + (h * GROUP + g) * a->q_head, HEAD_DIM * 2);
        limit[r] = r < rows ? offset + i : -1;
        m_run[r] = -INFINITY;
        l_run[r] = 0.0f;
    }
    memset(obuf, 0, sizeof(float) * ROWS_PAD * HEAD_DIM);
    const int64_t kend = offset + i1; /* keys [0, kend) */
    const __m512 scale = _mm512_set1_ps(a->scale);
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int64_t kb = 0; kb < kend; kb += KB) {
        const uint32_t* kblk = kp + (kb / KB) * D2 * KB;
        for (int64_t r0 = 0; r0 < rows_pad; r0 += MR) {
            __m512 s[MR][4];
            for (int r = 0; r < MR; r++)
                for (int z = 0; z < 4; z++) s[r][z] = _mm512_setzero_ps();
            for (int d = 0; d < D2; d++) {
                const uint32_t* kd = kblk + d * KB;
                const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kd);
                const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kd + 16);
                const __m512bh k2 = (__m512bh)_mm512_loadu_si512(kd + 32);
                const __m512bh k3 = (__m512bh)_mm512_loadu_si512(kd + 48);
                for (int r = 0; r < MR; r++) {
                    const __m512bh qv = (__m512bh)_mm512_set1_epi32((int)qbuf[(r0 + r) * D2 + d]);
                    s[r][0] = _mm512_dpbf16_ps(s[r][0], qv, k0);
                    s[r][1] = _mm512_dpbf16_ps(s[r][1], qv, k1);
                    s[r][2] = _mm512_dpbf16_ps(s[r][2], qv, k2);
                    s[r][3] = _mm512_dpbf16_ps(s[r][3], qv, k3);
                }
            }
            for (int r = 0; r < MR; r++) { /* online softmax of this block's scores */
                const int64_t row = r0 + r;
                /* key kb + j is visible iff j <= last */
                const __m512i last = _mm512_set1_epi32((int)(limit[row] - kb));
                __mmask16 keep[4];
                __m512 mx = _mm512_set1_ps(-INFINITY);
                for (int z = 0; z < 4; z++) {
                    const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(16 * z));
                    keep[z] = _mm512_cmple_epi32_mask(key, last);
                    s[r][z] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), keep[z], s[r][z], scale);
                    mx = _mm512_max_ps(mx, s[r][z]);
                }
                const float block_max = _mm512_reduce_max_ps(mx);
                const float m_new = block_max > m_run[row] ? block_max : m_run[row];
                if (m_new == -INFINITY) { /* padding row, or no visible key yet */
                    alpha[row] = 1.0f;
                    memset(pbuf + row * KB, 0, KB * 2);
                    continue;
                }
                alpha[row] = expf(m_run[row] - m_new);
                m_run[row] = m_new;
                const __m512 mv = _mm512_set1_ps(m_new);
                __m512 sum = _mm512_setzero_ps();
                for (int z = 0; z < 4; z++) {
                    const __m512 p = _mm512_maskz_mov_ps(keep[z], exp_ps(_mm512_sub_ps(s[r][z], mv)));
                    const __m256bh pb = _mm512_cvtneps_pbh(p);
                    sum = _mm512_add_ps(sum, _mm512_cvtpbh_ps(pb)); /* the sum of what P V multiplies */
                    _mm256_storeu_si256((__m256i*)(pbuf + row * KB + 16 * z), (__m256i)pb);
                }
                l_run[row] = l_run[row] * alpha[row] + _mm512_reduce_add_ps(sum);
            }
        }
        const int64_t pairs = ((kend - kb < KB ? kend - kb : KB) + 1) / 2;
        const uint32_t* vblk = vp + (kb / 2) * HEAD_DIM;
        for (int64_t r0 = 0; r0 < rows_pad; r0 += PR) {
            __m512 o[PR][DZ];
            for (int r = 0; r < PR; r++) {
                const __m512 al = _mm512_set1_ps(alpha[r0 + r]);
                for (int z = 0; z < DZ; z++)
                    o[r][z] = _mm512_mul_ps(_mm512_loadu_ps(obuf + (r0 + r) * HEAD_DIM + 16 * z), al);
            }
            for (int64_t p = 0; p < pairs; p++) {
                __m512bh vv[DZ];
                for (int z = 0; z < DZ; z++)
                    vv[z] = (__m512bh)_mm512_loadu_si512(vblk + p * HEAD_DIM + 16 * z);
                for (int r = 0; r < PR; r++) {
                    uint32_t word;
                    memcpy(&word, pbuf + (r0 + r) * KB + 2 * p, 4);
                    const __m512bh pv = (__m512bh)_mm512_set1_epi32((int)word);
                    for (int z = 0; z < DZ; z++) o[r][z] = _mm512_dpbf16_ps(o[r][z], pv, vv[z]);
                }
            }
            for (int r = 0; r < PR; r++)
                for (int z = 0; z < DZ; z++) _mm512_storeu_ps(obuf + (r0 + r) * HEAD_DIM + 16 * z, o[r][z]);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t i = i0 + r / GROUP, g = r % GROUP;
        uint16_t* dst = a->out + i * a->out_tok + (h * GROUP + g) * a->out_head;
        const float inv = 1.0f / l_run[r];
        for (int d = 0; d < HEAD_DIM; d++) dst[d] = to_bf16(obuf[r * HEAD_DIM + d] * inv);
    }
}

/* out[i, h * GROUP + g] = softmax(scale * q[i, h * GROUP + g] . K[0 .. L - n + i]) V, for
   i < n, every KV head h < hkv. Strides in elements. Returns nonzero if memory ran out. */
int prefill_attention(const uint16_t* q, int64_t q_tok, int64_t q_head, const uint16_t* k, int64_t k_tok,
                      int64_t k_head, const uint16_t* v, int64_t v_tok, int64_t v_head, uint16_t* out,
                      int64_t out_tok, int64_t out_head,
                      int64_t n, int64_t L, int64_t hkv, float scale, int num_threads) {
    const args_t a = {q, out, q_tok, q_head, out_tok, out_head, n, L, scale};
    const int64_t blocks = (L + KB - 1) / KB, head_words = blocks * KB * D2;
    uint32_t* kp = aligned_alloc(64, (size_t)(2 * hkv * head_words) * 4);
    if (!kp) return 1;
    uint32_t* vp = kp + hkv * head_words;
    const int64_t qblocks = (n + QB - 1) / QB, items = hkv * qblocks;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads) if(num_threads > 1)
    {
        #pragma omp for schedule(static)
        for (int64_t h = 0; h < hkv; h++) {
            pack_k((const uint32_t*)(k + h * k_head), k_tok / 2, L, blocks, kp + h * head_words);
            pack_v(v + h * v_head, v_tok, L, blocks, (uint16_t*)(vp + h * head_words));
        }
        uint32_t* qbuf = aligned_alloc(64, sizeof(uint32_t) * ROWS_PAD * D2);
        uint16_t* pbuf = aligned_alloc(64, 2 * ROWS_PAD * KB);
        float* obuf = aligned_alloc(64, sizeof(float) * ROWS_PAD * HEAD_DIM);
        if (!qbuf || !pbuf || !obuf) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (failed) continue;
            const int64_t qb = qblocks - 1 - it / hkv, h = it % hkv; /* last rows see most keys: first */
            const int64_t i0 = qb * QB, i1 = i0 + QB < n ? i0 + QB : n;
            attend_item(&a, kp + h * head_words, vp + h * head_words, h, i0, i1, qbuf, pbuf, obuf);
        }
        free(qbuf); free(pbuf); free(obuf);
    }
    free(kp);
    return failed;
}
"""
