/* Prefill on 4-bit weights with 8-bit integer dot products (AVX512-VNNI, CPU, OpenMP).
 *
 * A prompt's projection over hundreds of tokens is compute-bound. Expanding the 4-bit weight to
 * bf16 and running a bf16 GEMM (weight_dequant.c) tops out at the bf16 dot product's rate;
 * VPDPBUSD does 64 u8 x s8 products an instruction, twice VDPBF16PS's 32, so the same GEMM on
 * 8-bit activations against the 4-bit codes runs ~1.6x faster (measured on a Zen 5 EPYC, 2
 * threads, 2,048 tokens x 14,336 x 4,096: 185 ms, 1.30 TOPS, against 296 ms for the bf16
 * expansion and GEMM). This is what llama.cpp computes its 4-bit formats with: each token's
 * activations are quantized per block of 32 to int8 with their own step (act_quant.h), so a
 * block's product is exact in integers and the result differs from the float product of the
 * same weight by the activations' rounding alone.
 *
 *   int4pack_vnni_matmul     y [T, N] = x [T, K] W^T, W in torch's int4 pack
 *   int4_native_vnni_matmul  the same, W in int4_matmul.c's layout
 *
 * The resident weight is read as it is: each thread lays a slab of SLAB (64) rows out as this
 * kernel's tiles, one byte a code, in a buffer of its own (~260 KB for K = 4,096: it stays in
 * L2), then multiplies every token against that slab, 6 tokens at a time, so each 6 tokens'
 * activations are read from L1 by every tile of the slab. No weight-sized scratch exists.
 *
 * Tiles: 32 rows of W (two vectors of 16) by all of K. For block b of 32 along K, sub-step kk of
 * 4 (k = 32b + 4kk + e), vector v and row r:
 *     codes[tile][b][kk][v][r][e] = q[32 tile + 16 v + r][k]
 * so one 64-byte load is 16 rows x 4 codes, what VPDPBUSD multiplies against one token's 4
 * activation bytes broadcast. scales / mins [tile][b][32] fp32: w = q * scale + min.
 *
 *   sum_j w_j x_j  ~=  d * scale * sum_j q_j xq_j  +  min * d * sum_j xq_j
 *
 * A symmetric weight (min = -8 scale: GGUF's Q4_0 and every int4 weight with zero 0) folds the
 * second term into the integer sum (the accumulator starts at -8 sum_j xq_j), one multiply-add
 * fewer a block. The micro-kernel holds 6 tokens x 32 rows: 12 integer and 12 float accumulators.
 *
 * Built only where the compiler targets AVX512 (the avx512 and avx512_bf16 variants, with VNNI
 * enabled per function); the caller checks that the CPU has avx512_vnni (int4_vnni.py).
 * int4_vnni_built() says whether this build holds the kernel; elsewhere both calls return -2. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "act_quant.h"
#include "common.h"

#define QBLOCK 32
#define TILE_ROWS 32
#define SLAB 64 /* rows a thread lays out and multiplies at a time: two tiles */
#define MT 6    /* tokens a micro-kernel call */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define VNNI_BUILT 1
#include <immintrin.h>
#define VNNI __attribute__((target("avx512vnni")))
#else
#define VNNI_BUILT 0
#endif

int int4_vnni_built(void) { return VNNI_BUILT; }

#if VNNI_BUILT
/* A slab's tiles: codes [SLAB / 32][blocks][8][2][64] bytes; scales and mins
 * [SLAB / 32][blocks][32]. */
typedef struct {
    uint8_t* codes;
    float* scales;
    float* mins;
} Slab;

/* The resident weight, in either layout (one of the two readers below fills a slab). */
typedef struct {
    const uint8_t* packed;
    const uint16_t* scales_zeros; /* torch's pack: bf16 [K / 32, N, 2] */
    const float* scales;          /* the native layout: fp32 [N, K / 32] each */
    const float* mins;
    int64_t block_n; /* torch's pack: rows a block; 0 for the native layout */
    int halves;
} Int4Source;

/* One tile's codes for one (block, kk, v): 16 rows x 4 codes, 64 bytes. */
INLINE int64_t code_offset(int64_t tile, int64_t blocks, int64_t b, int kk, int v) {
    return (((tile * blocks + b) * 8 + kk) * 2 + v) * 64;
}

/* Row r of the slab: its 32 codes of block b (q[j]) into their places in the tiles. */
INLINE void put_block_row(uint8_t* codes, int64_t blocks, int64_t r, int64_t b, const uint8_t* q) {
    const int64_t tile = r / TILE_ROWS, rr = r % TILE_ROWS;
    const int v = (int)(rr / 16), lane = (int)(rr % 16);
    for (int kk = 0; kk < 8; kk++)
        memcpy(codes + code_offset(tile, blocks, b, kk, v) + lane * 4, q + 4 * kk, 4);
}

/* Four K-rows (k0..k3) of 32 codes each (a 64-row block's low or high nibbles: 32 rows) ->
 * the two 64-byte vectors of rows 0..15 and 16..31, each row's 4 codes together. */
INLINE void transpose_4x32(const __m256i k[4], uint8_t* out_v0, uint8_t* out_v1) {
    const __m256i t0 = _mm256_unpacklo_epi8(k[0], k[1]), t1 = _mm256_unpackhi_epi8(k[0], k[1]);
    const __m256i t2 = _mm256_unpacklo_epi8(k[2], k[3]), t3 = _mm256_unpackhi_epi8(k[2], k[3]);
    /* per 128-bit lane (rows 0..15 | 16..31): rows 0-3, 4-7, 8-11, 12-15 of the lane */
    const __m256i u0 = _mm256_unpacklo_epi16(t0, t2), u1 = _mm256_unpackhi_epi16(t0, t2);
    const __m256i u2 = _mm256_unpacklo_epi16(t1, t3), u3 = _mm256_unpackhi_epi16(t1, t3);
    _mm256_storeu_si256((__m256i*)out_v0, _mm256_permute2x128_si256(u0, u1, 0x20));
    _mm256_storeu_si256((__m256i*)(out_v0 + 32), _mm256_permute2x128_si256(u2, u3, 0x20));
    _mm256_storeu_si256((__m256i*)out_v1, _mm256_permute2x128_si256(u0, u1, 0x31));
    _mm256_storeu_si256((__m256i*)(out_v1 + 32), _mm256_permute2x128_si256(u2, u3, 0x31));
}

/* A full 64-row block of torch's AVX512 layout (byte j: row j low nibble, row 32 + j high),
 * K-block b, into the slab's tiles `tile` and `tile + 1`. */
INLINE void block64_to_tiles(const uint8_t* base, int64_t b, int64_t tile, int64_t blocks,
                             uint8_t* codes) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int kk = 0; kk < 8; kk++) {
        __m256i lo[4], hi[4];
        for (int e = 0; e < 4; e++) {
            const __m256i raw = _mm256_loadu_si256(
                (const __m256i*)(base + (b * QBLOCK + kk * 4 + e) * 32));
            lo[e] = _mm256_and_si256(raw, low);
            hi[e] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        }
        transpose_4x32(lo, codes + code_offset(tile, blocks, b, kk, 0),
                       codes + code_offset(tile, blocks, b, kk, 1));
        transpose_4x32(hi, codes + code_offset(tile + 1, blocks, b, kk, 0),
                       codes + code_offset(tile + 1, blocks, b, kk, 1));
    }
}

/* Code (n, k) of torch's pack (weight_dequant.c's comment): the slow path for layouts other than
 * full blocks of 64 in halves. */
INLINE uint8_t int4pack_code(const Int4Source* w, int64_t N, int64_t K, int64_t n, int64_t k) {
    const int64_t n0 = n / w->block_n * w->block_n;
    const int64_t nb = N - n0 < w->block_n ? N - n0 : w->block_n, i = n - n0;
    const int full = w->halves && nb == w->block_n;
    const int64_t byte = full ? i % (nb / 2) : i / 2;
    const int high = full ? i >= nb / 2 : i % 2;
    const uint8_t v = w->packed[n0 * K / 2 + k * nb / 2 + byte];
    return high ? v >> 4 : v & 0x0F;
}

/* Rows s0 .. s0 + SLAB of the weight as tiles. */
static void fill_slab(const Int4Source* w, int64_t N, int64_t K, int64_t s0, Slab* slab) {
    const int64_t blocks = K / QBLOCK;
    for (int64_t b = 0; b < blocks; b++) {
        for (int64_t r = 0; r < SLAB; r++) {
            const int64_t n = s0 + r;
            const int64_t at = ((r / TILE_ROWS) * blocks + b) * TILE_ROWS + r % TILE_ROWS;
            if (w->block_n) {
                const float sc = bf16_to_f32(w->scales_zeros[(b * N + n) * 2]);
                const float z = bf16_to_f32(w->scales_zeros[(b * N + n) * 2 + 1]);
                slab->scales[at] = sc;
                slab->mins[at] = z - 8.f * sc;
            } else {
                slab->scales[at] = w->scales[n * blocks + b];
                slab->mins[at] = w->mins[n * blocks + b];
            }
        }
        if (w->block_n == 64 && w->halves && N - s0 >= 64) { /* s0 % 64 == 0: a full block */
            block64_to_tiles(w->packed + s0 * K / 2, b, 0, blocks, slab->codes);
            continue;
        }
        for (int64_t r = 0; r < SLAB; r++) {
            const int64_t n = s0 + r;
            uint8_t q[QBLOCK];
            if (w->block_n) {
                for (int j = 0; j < QBLOCK; j++) q[j] = int4pack_code(w, N, K, n, b * QBLOCK + j);
            } else { /* native: low nibbles the block's first 16 codes, high its last 16 */
                const uint8_t* bytes = w->packed + (n * blocks + b) * 16;
                for (int j = 0; j < 16; j++) {
                    q[j] = bytes[j] & 0x0F;
                    q[16 + j] = bytes[j] >> 4;
                }
            }
            put_block_row(slab->codes, blocks, r, b, q);
        }
    }
}

/* Token rows quantized per block (act_quant.h): codes [Tp][K] (rows past T zero), each block's
 * step d and the sum of its codes. */
typedef struct {
    int8_t* q;
    float* d;
    int32_t* sum;
} QuantRows;

INLINE void quantize_row(int dtype, const void* x, int64_t t, int64_t K, QuantRows* out) {
    const int64_t blocks = K / QBLOCK;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t at = t * K + b * QBLOCK;
        float* d = out->d + t * blocks + b;
        out->sum[t * blocks + b] = quantize_block32(dtype, x, at, out->q + at, d);
    }
}

/* 16 floats stored as fp32 or bf16 (common.h's f32_to_bf16_x16). */
VNNI INLINE void store16(int dtype, void* out, int64_t at, __m512 v) {
    if (dtype == DTYPE_F32)
        _mm512_storeu_ps((float*)out + at, v);
    else
        _mm256_storeu_si256((__m256i*)((uint16_t*)out + at), f32_to_bf16_x16(v));
}

/* y[m][col .. col + 32) for MT token rows from m0 (mt of them real) against one tile. */
VNNI INLINE void micro_kernel(int dtype, int symmetric, const uint8_t* tile_codes,
                              const float* tile_scales, const float* tile_mins,
                              const QuantRows* xr, int64_t m0, int mt, int64_t K, void* out,
                              int64_t ldo, int64_t col) {
    const int64_t blocks = K / QBLOCK;
    __m512 f[MT][2];
    for (int m = 0; m < MT; m++) f[m][0] = f[m][1] = _mm512_setzero_ps();
    const int8_t* xq = xr->q + m0 * K;
    const float* xd = xr->d + m0 * blocks;
    const int32_t* xs = xr->sum + m0 * blocks;
    for (int64_t b = 0; b < blocks; b++) {
        __m512i a[MT][2];
        for (int m = 0; m < MT; m++) {
            /* symmetric: the -8 of every code, as an integer sum (exact) */
            const __m512i init = _mm512_set1_epi32(symmetric ? -8 * xs[m * blocks + b] : 0);
            a[m][0] = a[m][1] = init;
        }
        const uint8_t* wb = tile_codes + b * 8 * 2 * 64;
        for (int kk = 0; kk < 8; kk++) {
            const __m512i w0 = _mm512_loadu_si512(wb + (kk * 2) * 64);
            const __m512i w1 = _mm512_loadu_si512(wb + (kk * 2 + 1) * 64);
            for (int m = 0; m < MT; m++) {
                int32_t four;
                memcpy(&four, xq + m * K + b * QBLOCK + kk * 4, 4);
                const __m512i xb = _mm512_set1_epi32(four);
                a[m][0] = _mm512_dpbusd_epi32(a[m][0], w0, xb);
                a[m][1] = _mm512_dpbusd_epi32(a[m][1], w1, xb);
            }
        }
        for (int v = 0; v < 2; v++) {
            const __m512 s = _mm512_loadu_ps(tile_scales + b * TILE_ROWS + v * 16);
            const __m512 mn = _mm512_loadu_ps(tile_mins + b * TILE_ROWS + v * 16);
            for (int m = 0; m < MT; m++) {
                const float d = xd[m * blocks + b];
                const __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(d));
                f[m][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[m][v]), sd, f[m][v]);
                if (!symmetric)
                    f[m][v] = _mm512_fmadd_ps(
                        mn, _mm512_set1_ps(d * (float)xs[m * blocks + b]), f[m][v]);
            }
        }
    }
    for (int m = 0; m < mt; m++)
        for (int v = 0; v < 2; v++) store16(dtype, out, (m0 + m) * ldo + col + 16 * v, f[m][v]);
}

/* Every token against one slab: 6 tokens at a time over the slab's tiles (their activations stay
 * in L1 across the tiles; the slab in L2 across the tokens). */
VNNI static void slab_product(int dtype, int symmetric, const Slab* slab, const QuantRows* xr,
                              int64_t T, int64_t K, int64_t N, int64_t s0, void* out) {
    const int64_t blocks = K / QBLOCK;
    for (int64_t m0 = 0; m0 < T; m0 += MT) {
        const int mt = T - m0 < MT ? (int)(T - m0) : MT;
        for (int64_t tile = 0; tile < SLAB / TILE_ROWS; tile++) {
            const uint8_t* tc = slab->codes + tile * blocks * TILE_ROWS * QBLOCK;
            const float* ts = slab->scales + tile * blocks * TILE_ROWS;
            const float* tm = slab->mins + tile * blocks * TILE_ROWS;
            const int64_t col = s0 + tile * TILE_ROWS;
            if (dtype == DTYPE_BF16)
                micro_kernel(DTYPE_BF16, symmetric, tc, ts, tm, xr, m0, mt, K, out, N, col);
            else
                micro_kernel(DTYPE_F32, symmetric, tc, ts, tm, xr, m0, mt, K, out, N, col);
        }
    }
}

/* out [T, N] = x [T, K] W^T: quantize x, then slabs of W across the threads. 0, or -1 when a
 * buffer cannot be allocated. */
static int vnni_matmul(int dtype, const void* x, int64_t T, int64_t K, const Int4Source* w,
                       int symmetric, int64_t N, void* out, int nthreads) {
    const int64_t Tp = (T + MT - 1) / MT * MT, blocks = K / QBLOCK;
    QuantRows xr = {calloc((size_t)(Tp * K), 1), calloc((size_t)(Tp * blocks), sizeof(float)),
                    calloc((size_t)(Tp * blocks), sizeof(int32_t))};
    int failed = !xr.q || !xr.d || !xr.sum;
    if (!failed) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int64_t t = 0; t < T; t++) {
            if (dtype == DTYPE_BF16)
                quantize_row(DTYPE_BF16, x, t, K, &xr);
            else
                quantize_row(DTYPE_F32, x, t, K, &xr);
        }
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
        {
            Slab slab = {aligned_alloc(64, (size_t)(SLAB * K)),
                         malloc(sizeof(float) * (size_t)(SLAB * blocks)),
                         malloc(sizeof(float) * (size_t)(SLAB * blocks))};
            if (!slab.codes || !slab.scales || !slab.mins) {
                failed = 1;
            } else {
#pragma omp for schedule(static)
                for (int64_t s0 = 0; s0 < N; s0 += SLAB) {
                    fill_slab(w, N, K, s0, &slab);
                    slab_product(dtype, symmetric, &slab, &xr, T, K, N, s0, out);
                }
            }
            free(slab.codes);
            free(slab.scales);
            free(slab.mins);
        }
    }
    free(xr.q);
    free(xr.d);
    free(xr.sum);
    return failed ? -1 : 0;
}
#endif

/* out [T, N] (dtype of x: 0 fp32, 1 bf16) = x [T, K] W^T, W in torch's int4 pack [N, K / 2]
 * (`block_n`, `halves`: int4pack_layout()) with bf16 scales_zeros [K / 32, N, 2] (group 32):
 * w = (q - 8) scale + zero. Returns 0; -1 when a buffer cannot be allocated; -2 when this build
 * has no VNNI kernel or the shape is not N % 64 == 0, K % 32 == 0, blocks of 64 rows or fewer. */
int int4pack_vnni_matmul(int dtype, const void* x, int64_t T, int64_t K, const uint8_t* packed,
                         const uint16_t* scales_zeros, int64_t block_n, int halves, int symmetric,
                         int64_t N, void* out, int nthreads) {
#if VNNI_BUILT
    if (N % SLAB || K % QBLOCK || block_n <= 0 || SLAB % block_n) return -2;
    const Int4Source w = {packed, scales_zeros, NULL, NULL, block_n, halves};
    return vnni_matmul(dtype, x, T, K, &w, symmetric, N, out, nthreads);
#else
    (void)dtype, (void)x, (void)T, (void)K, (void)packed, (void)scales_zeros, (void)block_n;
    (void)halves, (void)symmetric, (void)N, (void)out, (void)nthreads;
    return -2;
#endif
}

/* The same for int4_matmul.c's layout (packed [N, K / 2], per block of 32 low nibbles the first
 * 16 codes, high the last 16; w = q * scale + min, fp32 [N, K / 32]); input read once. */
int int4_native_vnni_matmul(int dtype, const void* x, int64_t T, int64_t K, const uint8_t* packed,
                            const float* scales, const float* mins, int symmetric, int64_t N,
                            void* out, int nthreads) {
#if VNNI_BUILT
    if (N % SLAB || K % QBLOCK) return -2;
    const Int4Source w = {packed, NULL, scales, mins, 0, 0};
    return vnni_matmul(dtype, x, T, K, &w, symmetric, N, out, nthreads);
#else
    (void)dtype, (void)x, (void)T, (void)K, (void)packed, (void)scales, (void)mins;
    (void)symmetric, (void)N, (void)out, (void)nthreads;
    return -2;
#endif
}
