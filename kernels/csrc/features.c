/* What this build of the kernels computes with, so that callers and tests can tell which path
 * serves bf16 and how wide the attention kernels' vectors are (both fixed at compile time: each
 * ISA variant of native.py is its own build). */
#include "attention_bf16.h"
#include "vec.h"

enum {
    FEATURE_BF16_DOT = 1,         /* bf16 attention and fused ops on AVX512-BF16 dot products */
    FEATURE_VECTOR_BITS_SHIFT = 8 /* bits 8..: the lane vectors' width in bits (VL * 32) */
};

int kernel_features(void) {
    return (CHATSTORE_BF16_DOT ? FEATURE_BF16_DOT : 0) | (VL * 32) << FEATURE_VECTOR_BITS_SHIFT;
}
