/* Activations quantized per block of 32 to int8, as llama.cpp's Q8 activations: the step
 * d = max|x| / 127 and xq = round(x / d) (to nearest even), so a block's dot product with
 * integer weight codes is exact in integers. Shared by int4_matmul.c (decode, AVX2) and
 * int4_vnni.c (prefill, AVX512-VNNI), which must quantize alike. */
#ifndef CHATSTORE_ACT_QUANT_H
#define CHATSTORE_ACT_QUANT_H

#include <math.h>
#include <stdint.h>

#include "common.h"

#define ACT_QBLOCK 32

/* The 32 values of x from element `at` (dtype a compile-time constant at each call) into q;
 * returns the sum of the codes, and the step in *d (0 for an all-zero block). */
INLINE int32_t quantize_block32(int dtype, const void* x, int64_t at, int8_t* q, float* d) {
    float v[ACT_QBLOCK], amax = 0.f;
    for (int j = 0; j < ACT_QBLOCK; j++) {
        v[j] = load_elem(dtype, x, at + j);
        const float a = fabsf(v[j]);
        amax = a > amax ? a : amax;
    }
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t sum = 0;
    for (int j = 0; j < ACT_QBLOCK; j++) {
        q[j] = (int8_t)nearbyintf(v[j] * inv);
        sum += q[j];
    }
    *d = amax / 127.f;
    return sum;
}

#endif
