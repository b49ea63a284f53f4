/* 16-lane fp32 vectors (GCC vector extensions, any ISA) and the lane-wise online softmax that the
 * paged-prefill kernels share: the fp32 path and the AVX512-BF16 path run the same softmax. */
#ifndef CHATSTORE_VEC16_H
#define CHATSTORE_VEC16_H

#include <math.h>
#include <stdint.h>

#include "common.h"

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

#define NV 2            /* lane vectors per work item */
#define LANES (16 * NV) /* query rows per work item */
#define CHUNK 16        /* keys per chunk */

INLINE v16 splat(float x) { return (v16){0} + x; }

INLINE v16 select_v(i16 mask, v16 a, v16 b) { return (v16)(((i16)a & mask) | ((i16)b & ~mask)); }

/* exp of 16 lanes (the polynomial of exp_f32 in common.h); lanes below -87 give 0. */
INLINE v16 exp_v16(v16 x) {
    const i16 under = x < -87.f; /* comparisons give 0 / -1 lanes */
    v16 xc = select_v(under, splat(-87.f), x);
    xc = select_v(xc > 88.f, splat(88.f), xc);
    EXP_REDUCE_AND_POLY(v16, xc, n, p);
    const i16 bits = (__builtin_convertvector(n, i16) + 127) << 23;
    return (v16)((i16)(p * (v16)bits) & ~under);
}

/* Flash attention's online softmax, lane-wise, over the scores s[o][g] of a chunk of n keys
 * starting at position t0: keys past a lane's position are masked, s becomes exp(s - new max),
 * m and l are updated, and corr[g] is the factor the lane's running output must be scaled by.
 * min_pos: the smallest position of the item's rows; a chunk at or below it needs no mask (most
 * chunks of a long prompt). nv: the lane vectors in use (NV; decode's fewer rows may use 1).
 * Returns whether any corr differs from 1 (a new max in some lane). */
INLINE int online_softmax(v16 s[CHUNK][NV], int64_t n, int64_t t0, int64_t min_pos,
                          const i16* pos, v16* m, v16* l, v16* corr, int nv) {
    const int masked = t0 + n - 1 > min_pos;
    i16 rescale = {0};
    for (int g = 0; g < nv; g++) {
        v16 mx = m[g];
        for (int64_t o = 0; o < n; o++) {
            if (masked)
                s[o][g] = select_v(pos[g] >= (int32_t)(t0 + o), s[o][g], splat(-INFINITY));
            mx = select_v(s[o][g] > mx, s[o][g], mx);
        }
        /* Lanes that have seen no key yet keep m = -inf: subtract 0 there (no inf - inf). */
        const v16 base = select_v(mx == -INFINITY, (v16){0}, mx);
        corr[g] = exp_v16(m[g] - base);
        v16 sum = (v16){0};
        for (int64_t o = 0; o < n; o++) {
            s[o][g] = exp_v16(s[o][g] - base);
            sum += s[o][g];
        }
        l[g] = l[g] * corr[g] + sum;
        m[g] = mx;
        rescale |= corr[g] != 1.f;
    }
    int any = 0;
    for (int i = 0; i < 16; i++) any |= rescale[i];
    return any;
}

#endif
