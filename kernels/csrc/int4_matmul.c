/* y = x W^T for a group-32 int4 weight, with integer dot products (CPU, OpenMP): what llama.cpp
 * does for its 4-bit formats, and what a CPU without AVX512-BF16 needs (torch's int4 kernel
 * takes bf16 activations, which such a CPU emulates: measured 2-3x slower than this there).
 *
 *   W        [N, K] codes q in 0..15, in blocks of 32 along K: w = q * scale[n, b] + min[n, b]
 *   packed   [N, K / 2] uint8: block b of row n is 16 bytes, byte j = q[32b + j] | q[32b + 16 + j] << 4
 *            (low nibbles the block's first 16 codes, high nibbles its last 16)
 *   x        [T, Kx] fp32 or bf16, Kx = K / repeat: column k of W multiplies x[k mod Kx] (an
 *            8-bit code carried as two 4-bit ones reads the input twice: gguf_repack.py)
 *
 * Each token's row of x is quantized per block of 32 to int8 (xq = round(x / d), d = max|x| / 127)
 * and a block's dot product is exact in integers:
 *
 *   sum_j w_j x_j  ~=  d * (scale * sum_j q_j xq_j  +  min * sum_j xq_j)
 *
 * On AVX2 sum_j q_j xq_j is VPMADDUBSW (u8 x s8 pairs to s16: at most 2 * 15 * 127, no saturation)
 * then VPMADDWD into 8 int32 lanes, converted and scaled once per block; the min term is a
 * float dot product over the row's blocks. Elsewhere the same sums run as scalar integer loops (identical results:
 * integer sums are exact, and the per-block float arithmetic is the same). Rows of W are taken
 * 4 at a time (their blocks share each activation load) and every token of x runs over a tile
 * while it is in L1, so W is read once per call whatever T is.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "act_quant.h"
#include "common.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define QBLOCK 32
#define ROW_TILE 4

/* Token rows of x quantized per block: codes [T][Kx], and per block its step d and d * sum(xq). */
typedef struct {
    int8_t* q;
    float* d;
    float* dsum;
} QuantizedX;

static void quantize_rows(int dtype, const void* x, int64_t T, int64_t Kx, QuantizedX* out) {
    const int64_t blocks = Kx / QBLOCK;
    for (int64_t t = 0; t < T; t++) {
        for (int64_t b = 0; b < blocks; b++) {
            float d;
            const int64_t at = t * Kx + b * QBLOCK;
            const int32_t sum = quantize_block32(dtype, x, at, out->q + at, &d);
            out->d[t * blocks + b] = d;
            out->dsum[t * blocks + b] = d * (float)sum;
        }
    }
}

/* sum_j q_j xq_j over one block, as 8 int32 lanes (AVX2) or one int (scalar). */
#if defined(__AVX2__)
INLINE __m256i block_dot(const uint8_t* w, const int8_t* xq) {
    const __m128i raw = _mm_loadu_si128((const __m128i*)w);
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m256i codes = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low),
                                           _mm_and_si128(raw, low));
    const __m256i pairs = _mm256_maddubs_epi16(codes, _mm256_loadu_si256((const __m256i*)xq));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#else
INLINE int32_t block_dot_scalar(const uint8_t* w, const int8_t* xq) {
    int32_t s = 0;
    for (int j = 0; j < 16; j++) s += (int32_t)(w[j] & 0x0F) * xq[j] + (int32_t)(w[j] >> 4) * xq[16 + j];
    return s;
}
#endif

/* sum_b min[n, b] * d_b * sum(xq_b) over row n's blocks: a plain dot product of two float rows
 * (the activation blocks repeat `blocks / xblocks` times), vectorised on its own instead of one
 * scalar multiply-add beside every block's integer dot. */
INLINE float mins_term(const float* mins_row, const float* xdsum, int64_t blocks,
                       int64_t xblocks) {
    float s = 0.f;
    for (int64_t seg = 0; seg < blocks; seg += xblocks) {
#pragma omp simd reduction(+ : s)
        for (int64_t b = 0; b < xblocks; b++) s += mins_row[seg + b] * xdsum[b];
    }
    return s;
}

/* y[t][n0 .. n0 + rows) for one token: rows of W from n0, blocks b of W over activation block
 * b mod xblocks. */
static void tile_token(const uint8_t* packed, const float* scales, const float* mins, int64_t K,
                       int64_t n0, int64_t rows, const int8_t* xq, const float* xd,
                       const float* xdsum, int64_t xblocks, float* y) {
    const int64_t blocks = K / QBLOCK;
#if defined(__AVX2__)
    __m256 acc[ROW_TILE];
    for (int r = 0; r < ROW_TILE; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0, xb = 0; b < blocks; b++, xb = xb + 1 == xblocks ? 0 : xb + 1) {
        const int8_t* xblock = xq + xb * QBLOCK;
        for (int64_t r = 0; r < rows; r++) {
            const int64_t at = (n0 + r) * blocks + b;
            const __m256 dot = _mm256_cvtepi32_ps(block_dot(packed + at * 16, xblock));
            acc[r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(scales[at] * xd[xb]), acc[r]);
        }
    }
    for (int64_t r = 0; r < rows; r++)
        y[r] = hsum(acc[r]) + mins_term(mins + (n0 + r) * blocks, xdsum, blocks, xblocks);
#else
    for (int64_t r = 0; r < rows; r++) {
        float acc = 0.f;
        for (int64_t b = 0, xb = 0; b < blocks; b++, xb = xb + 1 == xblocks ? 0 : xb + 1) {
            const int64_t at = (n0 + r) * blocks + b;
            const int32_t dot = block_dot_scalar(packed + at * 16, xq + xb * QBLOCK);
            acc += (float)dot * (scales[at] * xd[xb]);
        }
        y[r] = acc + mins_term(mins + (n0 + r) * blocks, xdsum, blocks, xblocks);
    }
#endif
}

/* dtype: 0 = float32, 1 = bfloat16 (x and out). K (columns of W) and Kx = K / repeat multiples of
 * 32. out [T, N]. Returns 0, or -1 when the quantized activations cannot be allocated. */
int int4_matmul(int dtype, const void* x, int64_t T, int64_t K, int64_t repeat,
                const uint8_t* packed, const float* scales, const float* mins, int64_t N,
                void* out, int nthreads) {
    const int64_t Kx = K / repeat, xblocks = Kx / QBLOCK;
    QuantizedX qx = {malloc((size_t)(T * Kx)), malloc(sizeof(float) * (size_t)(T * xblocks)),
                     malloc(sizeof(float) * (size_t)(T * xblocks))};
    if (!qx.q || !qx.d || !qx.dsum) {
        free(qx.q);
        free(qx.d);
        free(qx.dsum);
        return -1;
    }
    quantize_rows(dtype, x, T, Kx, &qx);
    const int64_t tiles = (N + ROW_TILE - 1) / ROW_TILE;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t tile = 0; tile < tiles; tile++) {
        const int64_t n0 = tile * ROW_TILE, rows = N - n0 < ROW_TILE ? N - n0 : ROW_TILE;
        for (int64_t t = 0; t < T; t++) {
            float y[ROW_TILE];
            tile_token(packed, scales, mins, K, n0, rows, qx.q + t * Kx, qx.d + t * xblocks,
                       qx.dsum + t * xblocks, xblocks, y);
            for (int64_t r = 0; r < rows; r++) store_elem(dtype, out, t * N + n0 + r, y[r]);
        }
    }
    free(qx.q);
    free(qx.d);
    free(qx.dsum);
    return 0;
}
