/* Quantized weights dequantised into a caller's 16/32-bit buffer, just in time for one GEMM
 * (CPU, OpenMP). Prefill runs a projection over hundreds of tokens, where a blocked 16-bit GEMM
 * beats the quantized kernels 2-2.6x; expanding the weight for that one call costs ~1/T of the
 * GEMM and keeps no 16-bit copy resident (`kernels/weight_dequant.py`).
 *
 *   int4pack_dequant   torch's `_convert_weight_to_int4pack_for_cpu` layout -> W^T [K, N]
 *   int4_native_dequant  int4_matmul.c's layout -> W [N, K]
 *   int8_dequant       [N, K] int8 with one scale a row -> W [N, K]
 *
 * torch's int4 pack is block-major over N: block i (rows n0 = i * block_n ..) is K rows of nb / 2
 * bytes at packed + n0 * K / 2, nb = min(block_n, N - n0). Inside a byte row, either
 *   halves  (a full block on torch's AVX2 / AVX512 kernels): byte j holds row n0 + j in its low
 *           nibble and row n0 + nb / 2 + j in its high one
 *   pairs   (a partial block, or torch's generic kernel): byte j holds rows n0 + 2j (low) and
 *           n0 + 2j + 1 (high)
 * block_n and which of the two a full block takes depend on the kernel torch dispatches to here;
 * the caller finds them by packing a probe (weight_dequant.py), so this file assumes neither.
 * Values: w = (q - 8) * scale + zero, scale / zero bf16 in scales_zeros [K / group, N, 2]. The
 * output [K, N] is W^T, what `x @ W^T` reads as a plain row-major [K, N] operand. */
#include <stdint.h>
#include <stdlib.h>

#include "common.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* One byte row of a block: nb values of output row k, from the group's float scales and zeros
 * (dtype is a constant at each call, so each instantiation is one plain loop). */
INLINE void expand_row(int dtype, const uint8_t* bytes, int64_t nb, int halves, const float* s,
                       const float* z, void* out, int64_t at) {
    const int64_t half = nb / 2;
    for (int64_t j = 0; j < half; j++) {
        const int64_t lo = halves ? j : 2 * j, hi = halves ? half + j : 2 * j + 1;
        store_elem(dtype, out, at + lo, (float)((bytes[j] & 0x0F) - 8) * s[lo] + z[lo]);
        store_elem(dtype, out, at + hi, (float)((bytes[j] >> 4) - 8) * s[hi] + z[hi]);
    }
}

#if defined(__AVX512F__)
/* 16 codes (bytes 0..15) times their scales plus zeros, as 16 floats. */
INLINE __m512 codes_to_f32(__m128i codes, const float* s, const float* z) {
    const __m512 q = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(codes),
                                                         _mm512_set1_epi32(8)));
    return _mm512_fmadd_ps(q, _mm512_loadu_ps(s), _mm512_loadu_ps(z));
}

/* 16 floats rounded to bf16 (common.h's f32_to_bf16_x16) and stored. */
INLINE void store_bf16x16(uint16_t* o, __m512 v) {
    _mm256_storeu_si256((__m256i*)o, f32_to_bf16_x16(v));
}

/* A full 64-row block in halves layout: 32 bytes -> 64 values (AVX512 torch's own layout). */
INLINE void expand_block64(int dtype, const uint8_t* bytes, const float* s, const float* z,
                           void* out, int64_t at) {
    const __m256i raw = _mm256_loadu_si256((const __m256i*)bytes);
    const __m256i low = _mm256_and_si256(raw, _mm256_set1_epi8(0x0F));
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(0x0F));
    const __m128i parts[4] = {_mm256_castsi256_si128(low), _mm256_extracti128_si256(low, 1),
                              _mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1)};
    for (int p = 0; p < 4; p++) {
        const __m512 v = codes_to_f32(parts[p], s + 16 * p, z + 16 * p);
        if (dtype == DTYPE_BF16)
            store_bf16x16((uint16_t*)out + at + 16 * p, v);
        else
            _mm512_storeu_ps((float*)out + at + 16 * p, v);
    }
}
#endif

/* out [K, N] in dtype (0 fp32, 1 bf16). Returns 0, or -1 when the per-thread scale rows cannot
 * be allocated. Work is split by groups of K: a group's scales are widened once, then its rows. */
int int4pack_dequant(int dtype, const uint8_t* packed, const uint16_t* scales_zeros, int64_t N,
                     int64_t K, int64_t group, int64_t block_n, int halves, void* out,
                     int nthreads) {
    const int64_t groups = K / group;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        float* s = malloc(sizeof(float) * (size_t)N);
        float* z = malloc(sizeof(float) * (size_t)N);
        if (!s || !z) {
            failed = 1;
        } else {
#pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; g++) {
                const uint16_t* sz = scales_zeros + g * N * 2;
                for (int64_t n = 0; n < N; n++) {
                    s[n] = bf16_to_f32(sz[2 * n]);
                    z[n] = bf16_to_f32(sz[2 * n + 1]);
                }
                /* block by block: a block's rows of this group are one contiguous read */
                for (int64_t n0 = 0; n0 < N; n0 += block_n) {
                    const int64_t nb = N - n0 < block_n ? N - n0 : block_n;
                    const int full = halves && nb == block_n;
                    for (int64_t k = g * group; k < (g + 1) * group; k++) {
                        const uint8_t* bytes = packed + n0 * K / 2 + k * nb / 2;
#if defined(__AVX512F__)
                        if (full && nb == 64) {
                            expand_block64(dtype, bytes, s + n0, z + n0, out, k * N + n0);
                            continue;
                        }
#endif
                        const int64_t at = k * N + n0;
                        if (dtype == DTYPE_BF16)
                            expand_row(DTYPE_BF16, bytes, nb, full, s + n0, z + n0, out, at);
                        else
                            expand_row(DTYPE_F32, bytes, nb, full, s + n0, z + n0, out, at);
                    }
                }
            }
        }
        free(s);
        free(z);
    }
    return failed ? -1 : 0;
}

/* int4_matmul.c's layout (packed [N, K / 2], per block of 32 low nibbles the first 16 codes, high
 * the last 16; w = q * scale + min, fp32 [N, K / 32]) -> out [N, K] in dtype. */
void int4_native_dequant(int dtype, const uint8_t* packed, const float* scales, const float* mins,
                         int64_t N, int64_t K, void* out, int nthreads) {
    const int64_t blocks = K / 32;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t* w = packed + (n * blocks + b) * 16;
            const float s = scales[n * blocks + b], m = mins[n * blocks + b];
            const int64_t at = n * K + b * 32;
            if (dtype == DTYPE_BF16) {
                uint16_t* o = (uint16_t*)out + at;
#pragma omp simd
                for (int j = 0; j < 16; j++) {
                    o[j] = f32_to_bf16((float)(w[j] & 0x0F) * s + m);
                    o[16 + j] = f32_to_bf16((float)(w[j] >> 4) * s + m);
                }
            } else {
                float* o = (float*)out + at;
#pragma omp simd
                for (int j = 0; j < 16; j++) {
                    o[j] = (float)(w[j] & 0x0F) * s + m;
                    o[16 + j] = (float)(w[j] >> 4) * s + m;
                }
            }
        }
    }
}

/* q [N, K] int8 times a bf16 scale per row -> out [N, K] in dtype. */
void int8_dequant(int dtype, const int8_t* q, const uint16_t* scales, int64_t N, int64_t K,
                  void* out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float s = bf16_to_f32(scales[n]);
        const int8_t* row = q + n * K;
        if (dtype == DTYPE_BF16) {
            uint16_t* o = (uint16_t*)out + n * K;
#pragma omp simd
            for (int64_t k = 0; k < K; k++) o[k] = f32_to_bf16((float)row[k] * s);
        } else {
            float* o = (float*)out + n * K;
#pragma omp simd
            for (int64_t k = 0; k < K; k++) o[k] = (float)row[k] * s;
        }
    }
}

/* Rows `ids` [T] of an int4 table -> out [T, width] in dtype: an embedding lookup from the
 * quantized table itself. `add_row(table, n, row)` adds row n's values into the zeroed fp32
 * `row` (a repeated row's width-wide slices summed, as in the product). Returns 0, -1 when a
 * row buffer cannot be allocated, -2 for an id outside [0, N). */
typedef void (*add_row_fn)(const void* table, int64_t n, float* row);

static int table_rows(int dtype, const void* table, add_row_fn add_row, int64_t N,
                      const int64_t* ids, int64_t T, int64_t width, void* out, int nthreads) {
    for (int64_t t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= N) return -2;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        float* row = malloc(sizeof(float) * (size_t)width);
        if (!row) {
            failed = 1;
        } else {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) {
                for (int64_t c = 0; c < width; c++) row[c] = 0.f;
                add_row(table, ids[t], row);
                for (int64_t c = 0; c < width; c++) store_elem(dtype, out, t * width + c, row[c]);
            }
        }
        free(row);
    }
    return failed ? -1 : 0;
}

/* torch's int4 pack (see the top of this file): w = (q - 8) * scale + zero, bf16 scales. */
typedef struct {
    const uint8_t* packed;
    const uint16_t* scales_zeros;
    int64_t N, K, group, block_n, width;
    int halves;
} int4pack_table;

static void int4pack_add_row(const void* table, int64_t n, float* row) {
    const int4pack_table* p = table;
    const int64_t n0 = n / p->block_n * p->block_n, j = n - n0;
    const int64_t nb = p->N - n0 < p->block_n ? p->N - n0 : p->block_n;
    const int full = p->halves && nb == p->block_n;
    const int64_t at = full ? (j < nb / 2 ? j : j - nb / 2) : j / 2;
    const int high = full ? j >= nb / 2 : (int)(j & 1);
    const uint8_t* base = p->packed + n0 * p->K / 2 + at;
    for (int64_t k = 0; k < p->K; k++) {
        const uint8_t b = base[k * (nb / 2)];
        const int q = high ? b >> 4 : b & 0x0F;
        const uint16_t* sz = p->scales_zeros + ((k / p->group) * p->N + n) * 2;
        row[k % p->width] += (float)(q - 8) * bf16_to_f32(sz[0]) + bf16_to_f32(sz[1]);
    }
}

/* Rows of W from torch's int4 pack -> out [T, K / repeat] (table_rows). */
int int4pack_rows(int dtype, const uint8_t* packed, const uint16_t* scales_zeros, int64_t N,
                  int64_t K, int64_t group, int64_t block_n, int halves, const int64_t* ids,
                  int64_t T, int64_t repeat, void* out, int nthreads) {
    const int4pack_table table = {packed, scales_zeros, N, K, group, block_n, K / repeat, halves};
    return table_rows(dtype, &table, int4pack_add_row, N, ids, T, K / repeat, out, nthreads);
}

/* int4_matmul.c's layout: w = q * scale + min per block of 32, fp32 scales and mins. */
typedef struct {
    const uint8_t* packed;
    const float *scales, *mins;
    int64_t K, width;
} int4_native_table;

static void int4_native_add_row(const void* table, int64_t n, float* row) {
    const int4_native_table* p = table;
    const int64_t blocks = p->K / 32;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t* w = p->packed + (n * blocks + b) * 16;
        const float s = p->scales[n * blocks + b], m = p->mins[n * blocks + b];
        const int64_t at = (b * 32) % p->width;
        for (int j = 0; j < 16; j++) {
            row[at + j] += (float)(w[j] & 0x0F) * s + m;
            row[at + 16 + j] += (float)(w[j] >> 4) * s + m;
        }
    }
}

/* Rows of W from int4_matmul.c's layout -> out [T, K / repeat] (table_rows). */
int int4_native_rows(int dtype, const uint8_t* packed, const float* scales, const float* mins,
                     int64_t N, int64_t K, const int64_t* ids, int64_t T, int64_t repeat,
                     void* out, int nthreads) {
    const int4_native_table table = {packed, scales, mins, K, K / repeat};
    return table_rows(dtype, &table, int4_native_add_row, N, ids, T, K / repeat, out, nthreads);
}
