/* Helpers shared by the native CPU kernels: bf16 <-> fp32 and a vectorisable exp. */
#ifndef CHATSTORE_COMMON_H
#define CHATSTORE_COMMON_H

#include <stdint.h>
#include <string.h>

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };

#define INLINE static inline __attribute__((always_inline))

INLINE float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, as torch does; NaN stays NaN. Branch-free, so that loops of it
 * vectorise (denormals are kept, unlike VCVTNEPS2BF16, which flushes them). */
INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint16_t rounded = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0 : rounded;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* f32_to_bf16 of 16 lanes, the same bits: round to nearest even, NaN -> 0x7fc0, denormals kept
 * (VCVTNEPS2BF16 would flush them, and needs AVX512-BF16). */
INLINE __m256i f32_to_bf16_x16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);
}
#endif

/* f rounded to bf16 and back: what a bf16 tensor would hold. */
INLINE float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* The body of exp for a clamped x (scalar or vector type T): x = n ln2 + r, |r| <= ln2 / 2, n
 * rounded by the 1.5 * 2^23 trick (vectorises, unlike roundf), e^r by its degree-7 Taylor
 * polynomial (relative error < 2e-7); 2^n is left to the caller (exponent bits). */
#define EXP_REDUCE(T, xc, n, r)                                                     \
    const T n = ((xc) * 1.44269504088896341f + 12582912.f) - 12582912.f;          \
    const T r = (xc) - n * 0.693145751953125f - n * 1.428606765330187e-06f

#define EXP_POLY7(T, r, p)                                                          \
    T p = (r) * (1.f / 5040.f) + 1.f / 720.f;                                     \
    p = p * (r) + 1.f / 120.f;                                                     \
    p = p * (r) + 1.f / 24.f;                                                      \
    p = p * (r) + 1.f / 6.f;                                                       \
    p = p * (r) + 0.5f;                                                            \
    p = p * (r) + 1.f;                                                             \
    p = p * (r) + 1.f

#define EXP_REDUCE_AND_POLY(T, xc, n, p) \
    EXP_REDUCE(T, xc, n, r_);            \
    EXP_POLY7(T, r_, p)

/* exp(x), branch-free so that gcc vectorises it: x = n ln2 + r, |r| <= ln2 / 2, e^r by its
 * degree-7 Taylor polynomial (relative error < 2e-7), 2^n by exponent bits. x is clamped to
 * [-87, 88]: below, the result is 0; above, the largest finite power it reaches. */
INLINE float exp_f32(float x) {
    const float xc = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
    EXP_REDUCE_AND_POLY(float, xc, n, p);
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return x < -87.f ? 0.f : p * scale;
}

/* Element access by dtype. Kernels call these with dtype a compile-time constant (an INLINE body
 * instantiated once per dtype), so the test folds away and each dtype gets its own loop. */
INLINE float load_elem(int dtype, const void* base, int64_t i) {
    return dtype == DTYPE_BF16 ? bf16_to_f32(((const uint16_t*)base)[i]) : ((const float*)base)[i];
}

INLINE void store_elem(int dtype, void* base, int64_t i, float f) {
    if (dtype == DTYPE_BF16)
        ((uint16_t*)base)[i] = f32_to_bf16(f);
    else
        ((float*)base)[i] = f;
}

/* A value as the tensor's dtype holds it (bf16 rounding; fp32 unchanged). */
INLINE float as_dtype(int dtype, float f) { return dtype == DTYPE_BF16 ? round_bf16(f) : f; }

#endif
