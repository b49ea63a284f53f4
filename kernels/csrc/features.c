/* What this build of the kernels computes with, so that callers and tests can tell which path
 * serves bf16 (the choice is made at compile time: the build targets the CPU it runs on). */
#include "attention_bf16.h"

enum { FEATURE_BF16_DOT = 1 }; /* bf16 attention and fused ops on AVX512-BF16 dot products */

int kernel_features(void) { return CHATSTORE_BF16_DOT ? FEATURE_BF16_DOT : 0; }
