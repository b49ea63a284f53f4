/* The AVX512-BF16 path of the paged-decode kernel (paged_decode.c), with the arithmetic of the
 * prefill item (paged_prefill_bf16.c) to the bit: continuous batching runs the same token in the
 * decode kernel in one step and in the prefill kernel in another (a mixed step attends in place),
 * so the two must give the same bits, or greedy tokens depend on the batch.
 *
 * Per query row and key, as the prefill item's lanes: the score is one fp32 accumulator over the
 * D/2 pairs (VDPBF16PS, pairs in order), unscaled; the same chunks of keys (16, never across a
 * block, from position 0), the same lane-wise online softmax (online_softmax_bf16, the scale in
 * its exponent) with rows in lanes, P
 * rounded to bf16 unnormalised (pair_lanes), PV pairs in order into fp32, the rescale by corr,
 * and out = bf16(acc * (1 / l)). Only the layout is decode's: keys in lanes for QK^T (K pairs
 * gathered once per chunk, shared by the G query heads) and dims in lanes for PV, so a query
 * head costs D/32 dot products per key instead of a whole lane vector's D/2.
 * tests/kernels/test_kernels_bf16.py pins decode == prefill bitwise. Built only where CHATSTORE_BF16_DOT.
 */
#include <math.h>
#include <stdint.h>

#include "attention_bf16.h"
#include "vec.h"

#if CHATSTORE_BF16_DOT

_Static_assert(VL == 16, "the bf16 dot-product path is written for 512-bit lane vectors");

size_t decode_bf16_scratch_bytes(int64_t D) {
    /* KT [D/2][16] pairs, VI [CHUNK/2][D] pairs, acc [LANES][D], sc [LANES][16], PW [CHUNK/2][LANES] */
    return (size_t)(D / 2 * 16 + CHUNK / 2 * D + LANES * D + LANES * 16 + CHUNK / 2 * LANES) * 4;
}

/* As paged_prefill_bf16.c: bf16(a[l]) and bf16(b[l]) side by side in 32-bit lane l. */
INLINE __m512i pair_lanes_d(vf a, vf b) {
    static const uint16_t order[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,
                                       21, 6,  22, 7,  23, 8,  24, 9,  25, 10, 26,
                                       11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i halves = (__m512i)_mm512_cvtne2ps_pbh((__m512)b, (__m512)a); /* [a | b] */
    return _mm512_permutexvar_epi16(_mm512_loadu_si512(order), halves);
}

#define QK_ROWS 4 /* query rows whose scores are accumulated together */
/* Blocks ahead whose K and V rows are prefetched as the current block's are read, row by row:
 * a pool's blocks lie anywhere after some churn, and the hardware prefetcher stops at each
 * block's end. One layer of 8 sequences at 5K of context from DRAM: 2.6 ms from scattered blocks
 * and 1.4 from blocks in order without; ~1.1 either way with 1 (2 and 4: no better). */
#define PF_BLOCKS 1

/* Rows r0 and r1 (NULL: a zero row) of D bf16 (D a multiple of 32) as D 32-bit pairs (r0[d],
 * r1[d]), in the order VPUNPCK{L,H}WD leave them: two instructions per 32 dims where
 * interleave_rows (dims in order) takes eight. Each pair keeps its dim, so an accumulator lane
 * sums the same products in the same order as before, only at another place: unpacked_at(d). */
INLINE void pair_rows_unpacked(const uint16_t* r0, const uint16_t* r1, uint32_t* dst, int64_t D) {
    for (int64_t d = 0; d < D; d += 32) {
        const __m512i a = _mm512_loadu_si512(r0 + d);
        const __m512i b = r1 ? _mm512_loadu_si512(r1 + d) : _mm512_setzero_si512();
        _mm512_storeu_si512(dst + d, _mm512_unpacklo_epi16(a, b));
        _mm512_storeu_si512(dst + d + 16, _mm512_unpackhi_epi16(a, b));
    }
}

/* Where dim d's pair sits in pair_rows_unpacked's order: in each 32 dims, the low halves of the
 * four 128-bit lanes (4 dims each), then the high halves. */
INLINE int64_t unpacked_at(int64_t d) {
    const int64_t w = d % 32, lane = w / 8, half = w % 8 / 4;
    return d - w + half * 16 + lane * 4 + w % 4;
}

/* Row i of a head's q rows, or (i >= rows) its row 0: a stand-in whose scores are dropped. */
INLINE const uint16_t* qrow(const uint16_t* q, int64_t i, int64_t rows, int64_t D) {
    return q + (i < rows ? i : 0) * D;
}

/* Query rows g0 .. g0 + per_head of each KV head h .. h + nh of sequence seq, nh * per_head <=
 * LANES rows in all: row i is head h + i / per_head's row g0 + i % per_head. All the rows are
 * lanes of the same vectors, so a chunk's softmax, the score transpose and P's pairing run once
 * for every KV head of the sequence (they ran once per KV head, with G of 16 lanes in use), and
 * the sequence's blocks are read once, in address order. A lane's arithmetic is the prefill
 * item's whichever rows share its vector: the bits do not change. */
INLINE void decode_rows(const Bf16Attention* A, const int64_t* table, int64_t seq, int64_t ctx,
                        int64_t h, int64_t nh, int64_t g0, int64_t per_head, void* scratch,
                        const int64_t D) {
    const int64_t G = A->G, B = A->B, Hkv = A->Hkv, stride = Hkv * D, rows = nh * per_head;
    uint32_t* kt = scratch;
    uint32_t* vi = kt + D / 2 * 16;
    float* acc = (float*)(vi + CHUNK / 2 * D);
    float* sc = acc + LANES * D;
    uint32_t* pw = (uint32_t*)(sc + LANES * 16);
    const int64_t last_pos = ctx - 1, num_blocks = (ctx + B - 1) / B;
    const int nv = rows > 16 ? 2 : 1; /* lane vectors holding rows */
    vint pos[NV];
    vf m[NV], l[NV];
    for (int g = 0; g < NV; g++) {
        for (int lane = 0; lane < 16; lane++)
            pos[g][lane] = g * 16 + lane < rows ? (int32_t)last_pos : -1;
        m[g] = splat(-INFINITY);
        l[g] = (vf){0};
    }
    for (int64_t i = 0; i < rows * D; i++) acc[i] = 0.f;
    for (int64_t i = 0; i < LANES * 16; i++) sc[i] = 0.f;
    const float exp2_scale = softmax_exp2_scale(A->scale);
    for (int64_t t0 = 0, n; t0 <= last_pos; t0 += n) {
        const int64_t o0 = t0 % B;
        n = last_pos + 1 - t0;
        n = n < CHUNK ? n : CHUNK;
        n = n < B - o0 ? n : B - o0; /* a chunk never crosses a block */
        const int64_t at = ((table[t0 / B] * B + o0) * Hkv + h) * D;
        /* the block PF_BLOCKS ahead, row by row as this one is read (0: none) */
        const int64_t ahead = t0 / B + PF_BLOCKS;
        const int64_t pf = ahead < num_blocks ? ((table[ahead] * B + o0) * Hkv + h) * D - at : 0;
        for (int64_t j = 0; j < nh; j++) {
            const uint16_t* kr = A->k + at + j * D;
            const uint16_t* q = A->q + (seq * A->Hq + (h + j) * G + g0) * D;
            if (pf)
                for (int64_t o = 0; o < n; o++)
                    for (int64_t c = 0; c < D; c += 32) __builtin_prefetch(kr + pf + o * stride + c);
            for (int64_t d0 = 0; d0 < D; d0 += 32) { /* KT[e][o]: key o's pair e */
                __m512i r[16];
                for (int64_t o = 0; o < 16; o++)
                    r[o] = o >= n         ? _mm512_setzero_si512()
                           : D - d0 >= 32 ? _mm512_loadu_si512(kr + o * stride + d0)
                                          : _mm512_maskz_loadu_epi16(0xFFFFu, kr + o * stride + d0);
                transpose16(r);
                for (int64_t e = 0; e < 16 && d0 / 2 + e < D / 2; e++)
                    _mm512_store_si512(kt + (d0 / 2 + e) * 16, r[e]);
            }
            for (int64_t i0 = 0; i0 < per_head; i0 += QK_ROWS) { /* QK_ROWS independent chains */
                __m512 s[QK_ROWS];
                for (int k = 0; k < QK_ROWS; k++) s[k] = _mm512_setzero_ps();
                for (int64_t e = 0; e < D / 2; e++) {
                    const __m512i k2 = _mm512_load_si512(kt + e * 16);
                    for (int k = 0; k < QK_ROWS; k++) /* rows past the head's: never read */
                        s[k] = dot_bf16(
                            s[k], _mm512_set1_epi32(load_pair(qrow(q, i0 + k, per_head, D) + 2 * e)),
                            k2);
                }
                for (int k = 0; k < QK_ROWS && i0 + k < per_head; k++)
                    _mm512_storeu_ps(sc + (j * per_head + i0 + k) * 16, s[k]);
            }
        }
        vf s[CHUNK][NV]; /* rows in lanes, as the prefill item has them */
        for (int g = 0; g < nv; g++) {
            __m512i r[16];
            for (int lane = 0; lane < 16; lane++)
                r[lane] = _mm512_loadu_si512(sc + (g * 16 + lane) * 16);
            transpose16(r);
            for (int64_t o = 0; o < n; o++) s[o][g] = (vf)r[o];
        }
        vf corr[NV];
        const int rescale =
            online_softmax_bf16(s, n, t0, last_pos, pos, m, l, corr, nv, exp2_scale);
        const int64_t pairs = (n + 1) / 2;
        for (int64_t p = 0; p < pairs; p++) {
            const int has_odd = 2 * p + 1 < n;
            for (int g = 0; g < nv; g++)
                _mm512_storeu_si512(pw + p * LANES + g * 16,
                                    pair_lanes_d(s[2 * p][g], has_odd ? s[2 * p + 1][g] : splat(0.f)));
        }
        for (int64_t j = 0; j < nh; j++) {
            const uint16_t* vr = A->v + at + j * D;
            if (pf)
                for (int64_t o = 0; o < n; o++)
                    for (int64_t c = 0; c < D; c += 32) __builtin_prefetch(vr + pf + o * stride + c);
            for (int64_t p = 0; p < pairs; p++) {
                const uint16_t* r1 = 2 * p + 1 < n ? vr + (2 * p + 1) * stride : NULL;
                if (D % 32 == 0)
                    pair_rows_unpacked(vr + 2 * p * stride, r1, vi + p * D, D);
                else
                    interleave_rows(vr + 2 * p * stride, r1, vi + p * D, D);
            }
            for (int64_t i = j * per_head; i < (j + 1) * per_head; i++) {
                const __m512 cf = _mm512_set1_ps(corr[i / 16][i % 16]);
                __m512 a[D / 16]; /* D / 16 independent chains */
                for (int64_t c = 0; c < D / 16; c++) {
                    a[c] = _mm512_loadu_ps(acc + i * D + 16 * c);
                    if (rescale) a[c] = _mm512_mul_ps(a[c], cf);
                }
                for (int64_t p = 0; p < pairs; p++) {
                    const __m512i w = _mm512_set1_epi32((int32_t)pw[p * LANES + i]);
                    for (int64_t c = 0; c < D / 16; c++)
                        a[c] = dot_bf16(a[c], w, _mm512_loadu_si512(vi + p * D + 16 * c));
                }
                for (int64_t c = 0; c < D / 16; c++) _mm512_storeu_ps(acc + i * D + 16 * c, a[c]);
            }
        }
    }
    for (int64_t i = 0; i < rows; i++) {
        uint16_t* out = A->out + (seq * A->Hq + (h + i / per_head) * G + g0 + i % per_head) * D;
        const float inv = 1.f / l[i / 16][i % 16];
        for (int64_t d = 0; d < D; d++)
            out[d] = f32_to_bf16(acc[i * D + (D % 32 == 0 ? unpacked_at(d) : d)] * inv);
    }
}

INLINE void decode_rows_of(const Bf16Attention* A, const int64_t* table, int64_t seq, int64_t ctx,
                           int64_t h, int64_t nh, int64_t g0, int64_t per_head, void* scratch) {
    if (A->D == 64)
        decode_rows(A, table, seq, ctx, h, nh, g0, per_head, scratch, 64);
    else if (A->D == 128)
        decode_rows(A, table, seq, ctx, h, nh, g0, per_head, scratch, 128);
    else
        decode_rows(A, table, seq, ctx, h, nh, g0, per_head, scratch, A->D);
}

void decode_item_bf16(const Bf16Attention* A, const int64_t* table, int64_t seq, int64_t ctx,
                      int64_t h0, int64_t nh, void* scratch) {
    const int64_t G = A->G;
    if (G > LANES) { /* a head's rows fill more than an item: LANES of one head at a time */
        for (int64_t h = h0; h < h0 + nh; h++)
            for (int64_t g0 = 0; g0 < G; g0 += LANES)
                decode_rows_of(A, table, seq, ctx, h, 1, g0, G - g0 < LANES ? G - g0 : LANES,
                               scratch);
        return;
    }
    const int64_t per_item = LANES / G; /* KV heads whose rows share an item's lanes */
    for (int64_t h = h0; h < h0 + nh; h += per_item)
        decode_rows_of(A, table, seq, ctx, h, h0 + nh - h < per_item ? h0 + nh - h : per_item, 0,
                       G, scratch);
}

#endif
