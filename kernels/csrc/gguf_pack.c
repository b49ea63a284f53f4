/* GGUF's 4/8-bit blocks packed straight into an int4 kernel's layout (CPU, OpenMP):
 *
 *   gguf_to_int4pack     torch's `_weight_int4pack_mm_for_cpu` layout: the bytes
 *                        `_convert_weight_to_int4pack_for_cpu` makes of the same codes
 *   gguf_to_int4_native  int4_matmul.c's layout (`pack_int4`'s bytes)
 *
 * without the [N, K] byte codes, their int32 copy (4 bytes a code) and the op's own pass that the
 * Python path made at load (issue 35: 5.4 of a 1B model's 7.8 s load). The integer codes are
 * copied as they are (`chatstore/model/gguf_repack.py` gives the scales, the formats and the
 * Python reference):
 *
 *   Q4_0  18 B a block of 32: d f16, 16 B (codes 0..15 low nibbles, 16..31 high)
 *   Q4_1  20 B: d, m f16, 16 B as Q4_0
 *   Q4_K  144 B a block of 256: d, dmin f16, 12 B of 6-bit scales, 128 B in 4 runs of 32 B:
 *         run j holds codes 64j..64j+31 in its low nibbles, 64j+32..64j+63 in its high ones
 *   Q8_0  34 B a block of 32: d f16, 32 int8; a code q rides on two 4-bit codes, (q >> 4) + 8
 *         in the first K columns and q & 15 in the last K (K_out = 2 K; see gguf_repack.py)
 *
 * Each group of 32 codes gets its scale and zero in torch's scales_and_zeros ([K_out / 32, N, 2]
 * bf16, w = (q - 8) s + z), from the block's f16 fields in fp32 as gguf_repack.py computes them
 * (Q4_0 s = d, z = 0; Q4_1 s = d, z = m + 8 d; Q4_K s = d sc, z = 8 d sc - dmin mn; Q8_0 s = 16 d,
 * z = 0 on the high halves, s = d, z = 8 d on the low), then rounded to bf16 as torch rounds.
 *
 * Each output row comes from its own address and type (`row_addr`, `row_type`), so a fused
 * projection (q/k/v, gate/up: several tensors, possibly of different 4-bit types) and Llama's
 * q/k row order (a permutation) pack in one pass. torch's layout (csrc/weight_dequant.c has the
 * picture): block-major over rows, block i = K rows of nb / 2 bytes; a full block in `halves`
 * holds rows j and nb / 2 + j in byte j's low and high nibbles, else rows 2j and 2j + 1. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#if defined(__SSE2__) || defined(__F16C__)
#include <immintrin.h>
#endif

enum { GGUF_Q4_0 = 0, GGUF_Q4_1 = 1, GGUF_Q4_K = 2, GGUF_Q8_0 = 3 };

/* IEEE half -> float, exactly (subnormals, infinities and NaN included): F16C's conversion
 * where the build has it, else the bits by hand. */
INLINE float f16_to_f32(const uint8_t* at) {
    const uint16_t h = (uint16_t)(at[0] | (at[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t u;
    if (exp == 0x1F) {
        u = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else { /* zero or subnormal: man * 2^-24, exact in fp32 */
        float f = (float)man * 5.9604644775390625e-8f;
        memcpy(&u, &f, 4);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

/* Q4_K's zero as gguf_repack.py computes it in fp32: two products rounded, then subtracted (no
 * fused multiply-add, which -ffp-contract=fast would otherwise make of it). */
__attribute__((optimize("fp-contract=off"))) static float q4_k_zero(float d, float sc, float dmin,
                                                                    float mn) {
    const float a = 8.0f * d * sc, b = dmin * mn;
    return a - b;
}

/* Row `src`'s scale and zero of each group of 32 codes, fp32, into s[g] and z[g]. */
static void row_scales(int type, const uint8_t* src, int64_t k_out, float* s, float* z) {
    switch (type) {
        case GGUF_Q4_0:
        case GGUF_Q4_1: {
            const int64_t size = type == GGUF_Q4_0 ? 18 : 20;
            for (int64_t b = 0; b < k_out / 32; b++) {
                const float d = f16_to_f32(src + b * size);
                s[b] = d;
                z[b] = type == GGUF_Q4_0 ? 0.f : f16_to_f32(src + b * size + 2) + 8 * d;
            }
            break;
        }
        case GGUF_Q4_K:
            for (int64_t b = 0; b < k_out / 256; b++) {
                const uint8_t* block = src + b * 144;
                const uint8_t* m = block + 4; /* 12 bytes of 6-bit scales and mins */
                const float d = f16_to_f32(block), dmin = f16_to_f32(block + 2);
                for (int j = 0; j < 8; j++) {
                    /* gguf's get_scale_min: sub-blocks 4..7 take 4 bits from bytes 8..11 and
                     * their top 2 from the top of bytes 0..3 (scales) or 4..7 (mins) */
                    const int sc = j < 4 ? m[j] & 63
                                         : (m[j + 4] & 0x0F) | ((m[j - 4] >> 2) & 0x30);
                    const int mn = j < 4 ? m[j + 4] & 63 : (m[j + 4] >> 4) | ((m[j] >> 2) & 0x30);
                    s[8 * b + j] = d * (float)sc;
                    z[8 * b + j] = q4_k_zero(d, (float)sc, dmin, (float)mn);
                }
            }
            break;
        case GGUF_Q8_0: {
            const int64_t blocks = k_out / 64; /* K / 32: the low halves' groups follow */
            for (int64_t b = 0; b < blocks; b++) {
                const float d = f16_to_f32(src + b * 34);
                s[b] = 16 * d;
                z[b] = 0.f;
                s[blocks + b] = d;
                z[blocks + b] = 8 * d;
            }
            break;
        }
    }
}

/* The 16 bytes at qs: codes lo[0..15] = low nibbles, hi[0..15] = high nibbles. */
INLINE void split_nibbles(const uint8_t* qs, int64_t n, uint8_t* lo, uint8_t* hi) {
    for (int64_t i = 0; i < n; i++) {
        lo[i] = qs[i] & 0x0F;
        hi[i] = qs[i] >> 4;
    }
}

/* Row `src` of type `type` as k_out codes 0..15 into `codes`. */
static void decode_row(int type, const uint8_t* src, int64_t k_out, uint8_t* codes) {
    switch (type) {
        case GGUF_Q4_0:
        case GGUF_Q4_1: {
            const int64_t head = type == GGUF_Q4_0 ? 2 : 4, size = head + 16;
            for (int64_t b = 0; b < k_out / 32; b++)
                split_nibbles(src + b * size + head, 16, codes + 32 * b, codes + 32 * b + 16);
            break;
        }
        case GGUF_Q4_K:
            for (int64_t b = 0; b < k_out / 256; b++)
                for (int64_t j = 0; j < 4; j++)
                    split_nibbles(src + b * 144 + 16 + 32 * j, 32, codes + 256 * b + 64 * j,
                                  codes + 256 * b + 64 * j + 32);
            break;
        case GGUF_Q8_0: {
            const int64_t k = k_out / 2;
            for (int64_t b = 0; b < k / 32; b++) {
                const int8_t* q = (const int8_t*)(src + b * 34 + 2);
                for (int64_t i = 0; i < 32; i++) {
                    codes[32 * b + i] = (uint8_t)((q[i] >> 4) + 8); /* arithmetic: -8..7 */
                    codes[k + 32 * b + i] = (uint8_t)(q[i] & 0x0F);
                }
            }
            break;
        }
    }
}

#define K_TILE 256 /* columns a block's rows are interleaved in at a time (codes stay in L1) */

#if defined(__SSE2__)
/* x[r] byte c -> x[BITREV4[c]] byte r: four rounds of unpacking pairs (lo to i, hi to i + 8),
 * each moving one bit of the column index into the vector index, reversed. */
static const int BITREV4[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

INLINE void transpose16x16(__m128i x[16]) {
    __m128i t[16];
    for (int i = 0; i < 8; i++) {
        t[i] = _mm_unpacklo_epi8(x[2 * i], x[2 * i + 1]);
        t[i + 8] = _mm_unpackhi_epi8(x[2 * i], x[2 * i + 1]);
    }
    for (int i = 0; i < 8; i++) {
        x[i] = _mm_unpacklo_epi16(t[2 * i], t[2 * i + 1]);
        x[i + 8] = _mm_unpackhi_epi16(t[2 * i], t[2 * i + 1]);
    }
    for (int i = 0; i < 8; i++) {
        t[i] = _mm_unpacklo_epi32(x[2 * i], x[2 * i + 1]);
        t[i + 8] = _mm_unpackhi_epi32(x[2 * i], x[2 * i + 1]);
    }
    for (int i = 0; i < 8; i++) {
        x[i] = _mm_unpacklo_epi64(t[2 * i], t[2 * i + 1]);
        x[i + 8] = _mm_unpackhi_epi64(t[2 * i], t[2 * i + 1]);
    }
}

/* A block of nb rows of Q4_0 / Q4_1 (half = nb / 2 a multiple of 16) straight from the qs
 * bytes, no codes buffer: for 16 byte-rows j and one block of 32 columns, the low rows' qs L
 * and the high rows' H give the 16 output rows of columns 0..15 as (L & 15) | (H << 4) and of
 * columns 16..31 as (L >> 4) | (H & 0xF0), transposed 16 x 16 (most of a large model's load). */
static void pack_q4_block(const int64_t* row_addr, const int8_t* row_type, int64_t half,
                          int full, int64_t k_out, uint8_t* dst) {
    const __m128i low = _mm_set1_epi8(0x0F), high = _mm_set1_epi8((char)0xF0);
    for (int64_t j0 = 0; j0 < half; j0 += 16) {
        const uint8_t* lo_src[16];
        const uint8_t* hi_src[16];
        int64_t lo_size[16], hi_size[16];
        for (int r = 0; r < 16; r++) {
            const int64_t j = j0 + r, lo = full ? j : 2 * j, hi = full ? half + j : 2 * j + 1;
            const int lo_q4_1 = row_type[lo] == GGUF_Q4_1, hi_q4_1 = row_type[hi] == GGUF_Q4_1;
            lo_src[r] = (const uint8_t*)(intptr_t)row_addr[lo] + (lo_q4_1 ? 4 : 2);
            hi_src[r] = (const uint8_t*)(intptr_t)row_addr[hi] + (hi_q4_1 ? 4 : 2);
            lo_size[r] = lo_q4_1 ? 20 : 18;
            hi_size[r] = hi_q4_1 ? 20 : 18;
        }
        for (int64_t b = 0; b < k_out / 32; b++) {
            __m128i a[16], c[16];
            for (int r = 0; r < 16; r++) {
                const __m128i l = _mm_loadu_si128((const __m128i*)(lo_src[r] + b * lo_size[r]));
                const __m128i h = _mm_loadu_si128((const __m128i*)(hi_src[r] + b * hi_size[r]));
                const __m128i h_up = _mm_and_si128(_mm_slli_epi16(h, 4), high);
                const __m128i l_down = _mm_and_si128(_mm_srli_epi16(l, 4), low);
                a[r] = _mm_or_si128(_mm_and_si128(l, low), h_up);
                c[r] = _mm_or_si128(l_down, _mm_and_si128(h, high));
            }
            transpose16x16(a);
            transpose16x16(c);
            for (int col = 0; col < 16; col++) {
                _mm_storeu_si128((__m128i*)(dst + (32 * b + col) * half + j0), a[BITREV4[col]]);
                _mm_storeu_si128((__m128i*)(dst + (32 * b + 16 + col) * half + j0),
                                 c[BITREV4[col]]);
            }
        }
    }
}
#endif

/* Whether rows [n0, n0 + nb) take pack_q4_block: all Q4_0 / Q4_1, a multiple of 32 rows. */
INLINE int q4_block(const int8_t* row_type, int64_t n0, int64_t nb) {
#if defined(__SSE2__)
    if (nb % 32) return 0;
    for (int64_t r = n0; r < n0 + nb; r++)
        if (row_type[r] != GGUF_Q4_0 && row_type[r] != GGUF_Q4_1) return 0;
    return 1;
#else
    (void)row_type, (void)n0, (void)nb;
    return 0;
#endif
}

/* Whether every row's type is known and its blocks divide k_out. */
static int rows_valid(const int8_t* row_type, int64_t N, int64_t k_out) {
    for (int64_t n = 0; n < N; n++) {
        const int t = row_type[n];
        const int64_t unit = t == GGUF_Q4_K ? 256 : t == GGUF_Q8_0 ? 64 : 32;
        if (t < GGUF_Q4_0 || t > GGUF_Q8_0 || k_out % unit) return 0;
    }
    return 1;
}

/* packed [N, K_out / 2] in torch's layout and scales_zeros [K_out / 32, N, 2] bf16. Returns 0,
 * -1 when a thread's buffers cannot be allocated, -2 for an unknown row type or a K_out its
 * type does not divide. */
int gguf_to_int4pack(const int64_t* row_addr, const int8_t* row_type, int64_t N, int64_t k_out,
                     int64_t block_n, int halves, uint8_t* packed, uint16_t* scales_zeros,
                     int nthreads) {
    if (!rows_valid(row_type, N, k_out)) return -2;
    const int64_t blocks = (N + block_n - 1) / block_n, groups = k_out / 32;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        uint8_t* codes = malloc((size_t)(block_n * k_out));
        float* s = malloc(sizeof(float) * (size_t)(2 * groups));
        if (!codes || !s) {
            failed = 1;
        } else {
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < blocks; i++) {
                const int64_t n0 = i * block_n, nb = N - n0 < block_n ? N - n0 : block_n;
                const int64_t half = nb / 2;
                const int full = halves && nb == block_n;
                const int fast = q4_block(row_type, n0, nb);
                for (int64_t r = 0; r < nb; r++) {
                    const uint8_t* src = (const uint8_t*)(intptr_t)row_addr[n0 + r];
                    if (!fast) decode_row(row_type[n0 + r], src, k_out, codes + r * k_out);
                    row_scales(row_type[n0 + r], src, k_out, s, s + groups);
                    uint16_t* sz = scales_zeros + 2 * (n0 + r);
                    for (int64_t g = 0; g < groups; g++) {
                        sz[g * 2 * N] = f32_to_bf16(s[g]);
                        sz[g * 2 * N + 1] = f32_to_bf16(s[groups + g]);
                    }
                }
                uint8_t* dst = packed + n0 * k_out / 2;
#if defined(__SSE2__)
                if (fast) {
                    pack_q4_block(row_addr + n0, row_type + n0, half, full, k_out, dst);
                    continue;
                }
#endif
                for (int64_t k0 = 0; k0 < k_out; k0 += K_TILE) {
                    const int64_t k1 = k0 + K_TILE < k_out ? k0 + K_TILE : k_out;
                    for (int64_t j = 0; j < half; j++) {
                        const uint8_t* lo = codes + (full ? j : 2 * j) * k_out;
                        const uint8_t* hi = codes + (full ? half + j : 2 * j + 1) * k_out;
                        for (int64_t k = k0; k < k1; k++)
                            dst[k * half + j] = (uint8_t)(lo[k] | (hi[k] << 4));
                    }
                }
            }
        }
        free(codes);
        free(s);
    }
    return failed ? -1 : 0;
}

/* int4_matmul.c's layout: packed [N, K_out / 2] (per block of 32 codes, byte i holds code i in
 * its low nibble and code 16 + i in its high one), fp32 scales and mins [N, K_out / 32] (w =
 * q s + min, min = z - 8 s: as kernels/int4_matmul.pack_int4 computes them). Returns as above. */
int gguf_to_int4_native(const int64_t* row_addr, const int8_t* row_type, int64_t N,
                        int64_t k_out, uint8_t* packed, float* scales, float* mins,
                        int nthreads) {
    if (!rows_valid(row_type, N, k_out)) return -2;
    const int64_t groups = k_out / 32;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        uint8_t* codes = malloc((size_t)k_out);
        float* z = malloc(sizeof(float) * (size_t)groups);
        if (!codes || !z) {
            failed = 1;
        } else {
#pragma omp for schedule(static)
            for (int64_t n = 0; n < N; n++) {
                const uint8_t* src = (const uint8_t*)(intptr_t)row_addr[n];
                decode_row(row_type[n], src, k_out, codes);
                float* s = scales + n * groups;
                row_scales(row_type[n], src, k_out, s, z);
                for (int64_t g = 0; g < groups; g++) {
                    mins[n * groups + g] = z[g] - 8 * s[g];
                    uint8_t* dst = packed + n * k_out / 2 + 16 * g;
                    for (int i = 0; i < 16; i++)
                        dst[i] = (uint8_t)(codes[32 * g + i] | (codes[32 * g + 16 + i] << 4));
                }
            }
        }
        free(codes);
        free(z);
    }
    return failed ? -1 : 0;
}
