/* The element-wise parts of a transformer layer, one pass over memory each (CPU, OpenMP).
 *
 *   rms_norm        out = w * (x / sqrt(mean(x^2) + eps))
 *   add_rms_norm    h += delta; out = rms_norm(h)           (residual add fused with the norm)
 *   rope_store_kv   q rotated in place; k rotated and v copied into the paged KV pool
 *   silu_mul        out = silu(gate) * up                    (gu = [gate | up] per row)
 *
 * Rounding follows transformers' eager ops in the tensor's dtype: in bf16 every op that torch
 * would round (each product, the sum, the normalised value before the weight) is rounded the
 * same way, so bf16 results match torch's op-by-op arithmetic; fp32 is fp32 throughout.
 *
 * Each entry point tests dtype once, outside its row loop, and runs a row body compiled for that
 * dtype (ROWS_BY_DTYPE): one loop per dtype, which gcc vectorises, bf16 <-> fp32 conversions
 * included (5x faster silu_mul in bf16 than the per-element test it replaces). Where the CPU
 * has AVX512-BF16 the bf16 sum of squares of the norm is a bf16 dot product of x with itself
 * (exact products, fp32 sum).
 */
#include <math.h>
#include <stdint.h>

#include "attention_bf16.h"
#include "common.h"

/* Rows of a [T, H] tensor at once: one thread for a decode step (fork/join costs more than a
 * 576-wide row), all threads for prefill. */
#define PAR_ROWS 8

/* for t < T: ROW(dtype, t, ...) over the threads, the loop written once per dtype so that ROW
 * (INLINE) is compiled with dtype a constant. (An INLINE body holding the omp loop would not do:
 * the parallel region is outlined before inlining, with dtype a run-time variable.) */
#define ROWS_BY_DTYPE(dtype, T, ROW, ...)                                         \
    do {                                                                          \
        if ((dtype) == DTYPE_BF16) {                                              \
            _Pragma("omp parallel for if (T >= PAR_ROWS)")                        \
            for (int64_t t = 0; t < (T); t++) ROW(DTYPE_BF16, t, __VA_ARGS__);    \
        } else {                                                                  \
            _Pragma("omp parallel for if (T >= PAR_ROWS)")                        \
            for (int64_t t = 0; t < (T); t++) ROW(DTYPE_F32, t, __VA_ARGS__);     \
        }                                                                         \
    } while (0)

INLINE float sum_squares(const int dtype, const void* x, int64_t at, int64_t H) {
#if CHATSTORE_BF16_DOT
    if (dtype == DTYPE_BF16) {
        const uint16_t* row = (const uint16_t*)x + at;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < H; i += 32) {
            const int64_t left = H - i;
            const __mmask32 m = left >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << left) - 1u);
            const __m512i v = _mm512_maskz_loadu_epi16(m, row + i);
            acc = dot_bf16(acc, v, v);
        }
        return _mm512_reduce_add_ps(acc);
    }
#endif
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < H; i++) {
        const float v = load_elem(dtype, x, at + i);
        ss += v * v;
    }
    return ss;
}

INLINE void norm_row(const int dtype, int64_t row, const void* x, const void* w, void* out,
                     int64_t H, float eps) {
    const int64_t at = row * H;
    const float inv = 1.f / sqrtf(sum_squares(dtype, x, at, H) / (float)H + eps);
    for (int64_t i = 0; i < H; i++) {
        const float n = as_dtype(dtype, load_elem(dtype, x, at + i) * inv);
        store_elem(dtype, out, at + i, n * load_elem(dtype, w, i));
    }
}

void rms_norm(int dtype, const void* x, const void* w, void* out, int64_t T, int64_t H,
              float eps) {
    ROWS_BY_DTYPE(dtype, T, norm_row, x, w, out, H, eps);
}

INLINE void add_norm_row(const int dtype, int64_t t, void* h, const void* delta, const void* w,
                         void* out, int64_t H, float eps) {
    const int64_t at = t * H;
    for (int64_t i = 0; i < H; i++)
        store_elem(dtype, h, at + i, load_elem(dtype, h, at + i) + load_elem(dtype, delta, at + i));
    norm_row(dtype, t, h, w, out, H, eps);
}

void add_rms_norm(int dtype, void* h, const void* delta, const void* w, void* out, int64_t T,
                  int64_t H, float eps) {
    ROWS_BY_DTYPE(dtype, T, add_norm_row, h, delta, w, out, H, eps);
}

/* x [D] rotated by cos, sin [D] (rotate-half convention) into dst; x may be dst. The two halves
 * are separate loops (no per-element index select), so both vectorise. */
INLINE void rotate(const int dtype, const void* x, int64_t xo, const void* cs, const void* sn,
                   int64_t co, void* dst, int64_t dof, int64_t D) {
    const int64_t half = D / 2;
    float tmp[512];
    for (int64_t d = 0; d < half; d++) {
        const float a = as_dtype(dtype, load_elem(dtype, x, xo + d) * load_elem(dtype, cs, co + d));
        const float b = as_dtype(dtype, -load_elem(dtype, x, xo + d + half) *
                                            load_elem(dtype, sn, co + d));
        tmp[d] = a + b;
    }
    for (int64_t d = half; d < D; d++) {
        const float a = as_dtype(dtype, load_elem(dtype, x, xo + d) * load_elem(dtype, cs, co + d));
        const float b = as_dtype(dtype, load_elem(dtype, x, xo + d - half) *
                                            load_elem(dtype, sn, co + d));
        tmp[d] = a + b;
    }
    for (int64_t d = 0; d < D; d++) store_elem(dtype, dst, dof + d, tmp[d]);
}

INLINE void rope_row(const int dtype, int64_t t, void* qkv, const void* cs, const void* sn,
                     const int64_t* slots, void* k_cache, void* v_cache, void* k_out, int64_t Hq,
                     int64_t Hkv, int64_t D) {
    const int64_t width = (Hq + 2 * Hkv) * D, elem = dtype == DTYPE_BF16 ? 2 : 4;
    const int64_t row = t * width, co = t * D, slot = slots[t] * Hkv * D;
    for (int64_t h = 0; h < Hq; h++)
        rotate(dtype, qkv, row + h * D, cs, sn, co, qkv, row + h * D, D);
    for (int64_t h = 0; h < Hkv; h++) {
        rotate(dtype, qkv, row + (Hq + h) * D, cs, sn, co, k_cache, slot + h * D, D);
        if (k_out)
            memcpy((char*)k_out + ((t * Hkv + h) * D) * elem,
                   (const char*)k_cache + (slot + h * D) * elem, D * elem);
    }
    memcpy((char*)v_cache + slot * elem, (const char*)qkv + (row + (Hq + Hkv) * D) * elem,
           Hkv * D * elem);
}

/* qkv [T, (Hq + 2 Hkv) D] rows of the fused projection; cos, sin [T, D]; slots [T] flat slot
 * (block * B + offset) of each token in the pool; k_cache, v_cache [N * B, Hkv, D].
 * q is rotated in place; the pre-RoPE k in qkv is left as it is (the store saves it).
 * k_out [T, Hkv, D], when not NULL, also receives the rotated k (for attention over the step's
 * own contiguous K, V). */
void rope_store_kv(int dtype, void* qkv, const void* cs, const void* sn, const int64_t* slots,
                   void* k_cache, void* v_cache, void* k_out, int64_t T, int64_t Hq, int64_t Hkv,
                   int64_t D) {
    ROWS_BY_DTYPE(dtype, T, rope_row, qkv, cs, sn, slots, k_cache, v_cache, k_out, Hq, Hkv, D);
}

INLINE void silu_row(const int dtype, int64_t t, const void* gu, void* out, int64_t I) {
    const int64_t g = t * 2 * I, o = t * I;
    for (int64_t i = 0; i < I; i++) {
        const float x = load_elem(dtype, gu, g + i);
        const float s = as_dtype(dtype, x / (1.f + exp_f32(-x)));
        store_elem(dtype, out, o + i, s * load_elem(dtype, gu, g + I + i));
    }
}

void silu_mul(int dtype, const void* gu, void* out, int64_t T, int64_t I) {
    ROWS_BY_DTYPE(dtype, T, silu_row, gu, out, I);
}
