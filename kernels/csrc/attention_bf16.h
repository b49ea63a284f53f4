/* The AVX512-BF16 attention paths: QK^T and PV as bf16 dot products (VDPBF16PS) with fp32
 * accumulation, K and V read as stored (no widened copy). Compiled only where the compiler
 * targets AVX512-BF16 (the build uses -march=native, so: where this CPU has it); elsewhere
 * CHATSTORE_BF16_DOT is 0 and the kernels keep their fp32 path (bf16 widened on load). */
#ifndef CHATSTORE_ATTENTION_BF16_H
#define CHATSTORE_ATTENTION_BF16_H

#include <stddef.h>
#include <stdint.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define CHATSTORE_BF16_DOT 1
#else
#define CHATSTORE_BF16_DOT 0
#endif

/* One layer's bf16 tensors and shapes, as both kernels see them. */
typedef struct {
    const uint16_t *q, *k, *v; /* q [T, Hq, D] rows q_stride apart; k, v [N, B, Hkv, D] */
    uint16_t* out;             /* [T, Hq, D] */
    int64_t Hq, Hkv, G, D, B;
    int64_t q_stride; /* elements from one token's q row to the next (Hq * D when packed) */
    float scale;
} Bf16Attention;

#if CHATSTORE_BF16_DOT
/* Scratch one thread needs for prefill_item_bf16, 64-byte aligned by the caller. */
size_t prefill_bf16_scratch_bytes(int64_t D);

/* The rows r0 .. r0 + rows (at most 32) of KV head h of one sequence: rows are (new token i,
 * head g) pairs, r = i * G + g; the sequence's first new token is q row q_row0, at position
 * first_pos; table is its block table. */
void prefill_item_bf16(const Bf16Attention* A, const int64_t* table, int64_t q_row0, int64_t h,
                       int64_t r0, int64_t rows, int64_t first_pos, void* scratch);

/* Scratch one thread needs for decode_item_bf16, 64-byte aligned by the caller. */
size_t decode_bf16_scratch_bytes(int64_t D);

/* The KV heads h0 .. h0 + nh of one sequence (context ctx, q at row `seq`): prefill_item_bf16
 * on its one new token, so decode and prefill give the same bits for the same query. */
void decode_item_bf16(const Bf16Attention* A, const int64_t* table, int64_t seq, int64_t ctx,
                      int64_t h0, int64_t nh, void* scratch);
#endif

#if CHATSTORE_BF16_DOT
#include <immintrin.h>
#include <string.h>

#include "common.h"
#include "vec.h"

/* acc[l] += a[2l] * b[2l] + a[2l+1] * b[2l+1]: 32 bf16 products, exact in fp32, summed in fp32. */
INLINE __m512 dot_bf16(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

/* Two adjacent bf16 (a pair along the reduction) as one 32-bit word, ready to broadcast. */
INLINE int32_t load_pair(const uint16_t* p) {
    int32_t w;
    memcpy(&w, p, 4);
    return w;
}

/* r[i][j] -> r[j][i]: a 16 x 16 transpose of 32-bit words in registers. */
INLINE void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int k = 0; k < 8; k++) {
        t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
        t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    }
    for (int k = 0; k < 4; k++) {
        r[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
        r[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
        r[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
        r[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
    }
    for (int k = 0; k < 2; k++)
        for (int j = 0; j < 4; j++) {
            t[8 * k + j] = _mm512_shuffle_i32x4(r[8 * k + j], r[8 * k + j + 4], 0x88);
            t[8 * k + j + 4] = _mm512_shuffle_i32x4(r[8 * k + j], r[8 * k + j + 4], 0xDD);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xDD);
    }
}

/* Rows r0 and r1 (NULL: a zero row) of D bf16 interleaved into D 32-bit pairs (r0[d], r1[d]):
 * the layout a dot product along the key index needs. D is a multiple of 16. */
INLINE void interleave_rows(const uint16_t* r0, const uint16_t* r1, uint32_t* dst, int64_t D) {
    for (int64_t d = 0; d < D; d += 16) {
        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(r0 + d)));
        __m512i pair = lo;
        if (r1) {
            const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(r1 + d)));
            pair = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
        }
        _mm512_storeu_si512(dst + d, pair);
    }
}

/* 2^x per lane for the bf16 kernels' probabilities: x = n + r with n = round(x), |r| <= 1/2,
 * 2^r by a degree-3 minimax polynomial (relative error < 7.5e-5: P is rounded to bf16, 2^-9,
 * next), times 2^n by VSCALEFPS; below -126 (-inf: a masked key, or a lane that has seen no key)
 * the mask gives 0. Seven instructions where exp's clamps, reduction by ln 2 and degree-4
 * polynomial took twelve. */
INLINE vf exp2_bf16(vf x) {
    const __m512 v = (__m512)x;
    const __mmask16 keep = _mm512_cmp_ps_mask(v, _mm512_set1_ps(-126.f), _CMP_GE_OQ);
    const __m512 n = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(v, n);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.05517121f), r, _mm512_set1_ps(0.24261023f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.69326103f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.99992818f));
    return (vf)_mm512_maskz_scalef_ps(keep, p, n);
}

/* The factor online_softmax_bf16 takes: scale * log2(e), rounded once, the same in both
 * kernels. */
INLINE float softmax_exp2_scale(float scale) { return scale * 1.44269504088896341f; }

/* vec.h's online softmax for the bf16 kernels, decode and prefill alike, in base 2 with the
 * scale folded in: s holds raw scores q.k (no scale applied), m their running max in those
 * units, and p = 2^(s * c - m * c) with c = scale * log2(e) is e^(scale * (s - m)), one FMA
 * where the scale's multiply, the subtraction and exp's reduction by ln 2 took four. A lane
 * whose max did not move gets corr exactly 1 (so the caller skips the rescale as before).
 *
 * In two halves, so that the prefill item can take the exponentials of one chunk between the
 * dot products of the next (they run beside them, where alone they held the vector units for
 * ~13 % of the kernel): softmax_max_bf16 masks, takes the max and the correction, and leaves
 * nb = -m * c; then each score becomes softmax_p_bf16 of it, summed per lane vector in key
 * order; then l = l * corr + sum (softmax_sum_bf16). online_softmax_bf16 is the three in a row. */
INLINE int softmax_max_bf16(vf s[CHUNK][NV], int64_t n, int64_t t0, int64_t min_pos,
                            const vint* pos, vf* m, vf* corr, vf* nb, int nv, float c) {
    const int masked = t0 + n - 1 > min_pos;
    int any = 0;
    for (int g = 0; g < nv; g++) {
        const vf mx = masked_chunk_max(s, n, t0, pos, g, masked, m[g]);
        const vf base = softmax_base(mx);
        const __mmask16 same = _mm512_cmp_ps_mask((__m512)mx, (__m512)m[g], _CMP_EQ_OQ);
        if (same == 0xFFFF) {
            corr[g] = splat(1.f);
        } else {
            const vf moved = exp2_bf16((m[g] - base) * c);
            corr[g] = (vf)_mm512_mask_blend_ps(same, (__m512)moved, _mm512_set1_ps(1.f));
            any = 1;
        }
        nb[g] = base * -c;
        m[g] = mx;
    }
    return any;
}

INLINE vf softmax_p_bf16(vf s, vf nb, float c) {
    return exp2_bf16((vf)_mm512_fmadd_ps((__m512)s, _mm512_set1_ps(c), (__m512)nb));
}

/* One FMA, spelled out: left to contraction, the two kernels' inlined copies could round it
 * differently. */
INLINE vf softmax_sum_bf16(vf l, vf corr, vf sum) {
    return (vf)_mm512_fmadd_ps((__m512)l, (__m512)corr, (__m512)sum);
}

INLINE int online_softmax_bf16(vf s[CHUNK][NV], int64_t n, int64_t t0, int64_t min_pos,
                               const vint* pos, vf* m, vf* l, vf* corr, int nv, float c) {
    vf nb[NV];
    const int any = softmax_max_bf16(s, n, t0, min_pos, pos, m, corr, nb, nv, c);
    for (int g = 0; g < nv; g++) {
        vf sum = (vf){0};
        for (int64_t o = 0; o < n; o++) {
            s[o][g] = softmax_p_bf16(s[o][g], nb[g], c);
            sum += s[o][g];
        }
        l[g] = softmax_sum_bf16(l[g], corr[g], sum);
    }
    return any;
}
#endif

#endif
