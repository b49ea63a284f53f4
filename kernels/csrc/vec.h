/* fp32 lane vectors as wide as the target's registers (GCC vector extensions, any ISA) and the
 * lane-wise online softmax of the fp32 paged-prefill path, with the chunk masking and max that
 * the AVX512-BF16 path's base-2 softmax (attention_bf16.h) shares.
 *
 * VL, the lanes of a vector, follows the build's target (native.py builds one variant per ISA):
 * 16 with AVX512, 8 with AVX/AVX2, 4 otherwise. A vector wider than the registers would be split
 * by the compiler into several, and the kernels' register tiles (QK_KEYS x NV accumulators) would
 * spill: 512-bit vectors on AVX2 ran the prefill attention several times slower. */
#ifndef CHATSTORE_VEC_H
#define CHATSTORE_VEC_H

#include <math.h>
#include <stdint.h>

#include "common.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VL 16
#elif defined(__AVX__)
#define VL 8
#else
#define VL 4
#endif

typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vint __attribute__((vector_size(VL * 4)));

#define NV 2            /* lane vectors per work item */
#define LANES (VL * NV) /* query rows per work item */
#define CHUNK 16        /* keys per chunk */

INLINE vf splat(float x) { return (vf){0} + x; }

INLINE vf select_v(vint mask, vf a, vf b) { return (vf)(((vint)a & mask) | ((vint)b & ~mask)); }

/* a > b ? a : b and a < b ? a : b per lane (b where either is NaN): exactly what x86's MAXPS and
 * MINPS compute, one instruction each, where the select above takes a compare and two or three
 * logic ops (gcc does not turn it into MAXPS: it cannot assume no NaN). */
INLINE vf max_v(vf a, vf b) {
#if VL == 16 && defined(__AVX512F__)
    return (vf)_mm512_max_ps((__m512)a, (__m512)b);
#elif VL == 8 && defined(__AVX__)
    return (vf)_mm256_max_ps((__m256)a, (__m256)b);
#elif VL == 4 && defined(__SSE__)
    return (vf)_mm_max_ps((__m128)a, (__m128)b);
#else
    return select_v(a > b, a, b);
#endif
}

INLINE vf min_v(vf a, vf b) {
#if VL == 16 && defined(__AVX512F__)
    return (vf)_mm512_min_ps((__m512)a, (__m512)b);
#elif VL == 8 && defined(__AVX__)
    return (vf)_mm256_min_ps((__m256)a, (__m256)b);
#elif VL == 4 && defined(__SSE__)
    return (vf)_mm_min_ps((__m128)a, (__m128)b);
#else
    return select_v(a < b, a, b);
#endif
}

/* exp of VL lanes (the reduction and polynomial of exp_f32 in common.h); lanes below -87 give
 * 0. (The bf16 kernels' probabilities take attention_bf16.h's exp2_bf16 instead.) */
INLINE vf exp_vf_of(vf x) {
    /* x clamped to [-87, 88] (a NaN stays NaN: MAXPS / MINPS return their second operand) */
    const vf xc = min_v(splat(88.f), max_v(splat(-87.f), x));
    EXP_REDUCE_AND_POLY(vf, xc, n, p);
#if VL == 16 && defined(__AVX512F__)
    /* p * 2^n and the zero below -87 in one VSCALEFPS under a mask, where the portable tail
     * takes five instructions (convert, add, shift, multiply, and-not): the same bits, as 2^n is
     * a normal float for every n the clamp lets through. */
    const __mmask16 keep = _mm512_cmp_ps_mask((__m512)x, _mm512_set1_ps(-87.f), _CMP_NLT_UQ);
    return (vf)_mm512_maskz_scalef_ps(keep, (__m512)p, (__m512)n);
#else
    const vint under = x < -87.f; /* comparisons give 0 / -1 lanes */
    const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
    return (vf)((vint)(p * (vf)bits) & ~under);
#endif
}

/* Lane vector g of a chunk's scores with the keys past each lane's position set to -inf (when
 * `masked`: the chunk reaches past min_pos), and the lanes' max over them and m. */
INLINE vf masked_chunk_max(vf s[CHUNK][NV], int64_t n, int64_t t0, const vint* pos, int g,
                           int masked, vf m) {
    vf mx = m;
    for (int64_t o = 0; o < n; o++) {
        if (masked) s[o][g] = select_v(pos[g] >= (int32_t)(t0 + o), s[o][g], splat(-INFINITY));
        mx = max_v(s[o][g], mx);
    }
    return mx;
}

/* What the exponent subtracts: the max, or 0 in lanes that have seen no key yet (m = -inf:
 * no inf - inf). */
INLINE vf softmax_base(vf mx) { return select_v(mx == -INFINITY, (vf){0}, mx); }

/* Flash attention's online softmax, lane-wise, over the scores s[o][g] of a chunk of n keys
 * starting at position t0 (the fp32 prefill kernel's; the bf16 kernels run attention_bf16.h's
 * online_softmax_bf16, in base 2): keys past a lane's position are masked, s becomes
 * exp(s - new max), m and l are updated, and corr[g] is the factor the lane's running output
 * must be scaled by. min_pos: the smallest position of the item's rows; a chunk at or below it
 * needs no mask (most chunks of a long prompt). Returns whether any corr differs from 1 (a new
 * max in some lane). */
INLINE int online_softmax(vf s[CHUNK][NV], int64_t n, int64_t t0, int64_t min_pos,
                          const vint* pos, vf* m, vf* l, vf* corr) {
    const int masked = t0 + n - 1 > min_pos;
    vint rescale = {0};
    for (int g = 0; g < NV; g++) {
        const vf mx = masked_chunk_max(s, n, t0, pos, g, masked, m[g]);
        const vf base = softmax_base(mx);
        /* No lane has a new max (most chunks past the first few): every corr is exp(0) = 1, and
         * a lane that has seen no key keeps l = 0 whatever its corr. */
        vint same = mx == m[g];
        int all_same = 1;
        for (int i = 0; i < VL; i++) all_same &= same[i] != 0;
        corr[g] = all_same ? splat(1.f) : exp_vf_of(m[g] - base);
        vf sum = (vf){0};
        for (int64_t o = 0; o < n; o++) {
            s[o][g] = exp_vf_of(s[o][g] - base);
            sum += s[o][g];
        }
        l[g] = l[g] * corr[g] + sum;
        m[g] = mx;
        rescale |= corr[g] != 1.f;
    }
    int any = 0;
    for (int i = 0; i < VL; i++) any |= rescale[i];
    return any;
}

#endif
