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
 */
#include <math.h>
#include <stdint.h>

#include "common.h"

/* Rows of a [T, H] tensor at once: one thread for a decode step (fork/join costs more than a
 * 576-wide row), all threads for prefill. */
#define PAR_ROWS 8

static void norm_row(int dtype, const void* x, const void* w, void* out, int64_t row, int64_t H,
                     float eps) {
    const int64_t at = row * H;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < H; i++) {
        const float v = load_elem(dtype, x, at + i);
        ss += v * v;
    }
    const float inv = 1.f / sqrtf(ss / (float)H + eps);
    for (int64_t i = 0; i < H; i++) {
        const float n = as_dtype(dtype, load_elem(dtype, x, at + i) * inv);
        store_elem(dtype, out, at + i, n * load_elem(dtype, w, i));
    }
}

void rms_norm(int dtype, const void* x, const void* w, void* out, int64_t T, int64_t H,
              float eps) {
#pragma omp parallel for if (T >= PAR_ROWS)
    for (int64_t t = 0; t < T; t++) norm_row(dtype, x, w, out, t, H, eps);
}

void add_rms_norm(int dtype, void* h, const void* delta, const void* w, void* out, int64_t T,
                  int64_t H, float eps) {
#pragma omp parallel for if (T >= PAR_ROWS)
    for (int64_t t = 0; t < T; t++) {
        const int64_t at = t * H;
        for (int64_t i = 0; i < H; i++)
            store_elem(dtype, h, at + i,
                       load_elem(dtype, h, at + i) + load_elem(dtype, delta, at + i));
        norm_row(dtype, h, w, out, t, H, eps);
    }
}

/* x [D] rotated by cos, sin [D] (rotate-half convention) into dst. */
INLINE void rotate(int dtype, const void* x, int64_t xo, const void* cs, const void* sn,
                   int64_t co, void* dst, int64_t dof, int64_t D) {
    const int64_t half = D / 2;
    float tmp[512];
    for (int64_t d = 0; d < D; d++) {
        const float xd = load_elem(dtype, x, xo + d);
        const float other = load_elem(dtype, x, xo + (d < half ? d + half : d - half));
        const float rot = d < half ? -other : other;
        const float a = as_dtype(dtype, xd * load_elem(dtype, cs, co + d));
        const float b = as_dtype(dtype, rot * load_elem(dtype, sn, co + d));
        tmp[d] = a + b;
    }
    for (int64_t d = 0; d < D; d++) store_elem(dtype, dst, dof + d, tmp[d]);
}

/* qkv [T, (Hq + 2 Hkv) D] rows of the fused projection; cos, sin [T, D]; slots [T] flat slot
 * (block * B + offset) of each token in the pool; k_cache, v_cache [N * B, Hkv, D].
 * q is rotated in place; the pre-RoPE k in qkv is left as it is (the store saves it).
 * k_out [T, Hkv, D], when not NULL, also receives the rotated k (for attention over the step's
 * own contiguous K, V). */
void rope_store_kv(int dtype, void* qkv, const void* cs, const void* sn, const int64_t* slots,
                   void* k_cache, void* v_cache, void* k_out, int64_t T, int64_t Hq, int64_t Hkv,
                   int64_t D) {
    const int64_t width = (Hq + 2 * Hkv) * D;
    const int64_t elem = dtype == DTYPE_BF16 ? 2 : 4;
#pragma omp parallel for if (T >= PAR_ROWS)
    for (int64_t t = 0; t < T; t++) {
        const int64_t row = t * width, co = t * D, slot = slots[t] * Hkv * D;
        for (int64_t h = 0; h < Hq; h++) rotate(dtype, qkv, row + h * D, cs, sn, co, qkv, row + h * D, D);
        for (int64_t h = 0; h < Hkv; h++) {
            rotate(dtype, qkv, row + (Hq + h) * D, cs, sn, co, k_cache, slot + h * D, D);
            if (k_out)
                memcpy((char*)k_out + ((t * Hkv + h) * D) * elem,
                       (const char*)k_cache + (slot + h * D) * elem, D * elem);
        }
        memcpy((char*)v_cache + slot * elem, (const char*)qkv + (row + (Hq + Hkv) * D) * elem,
               Hkv * D * elem);
    }
}

void silu_mul(int dtype, const void* gu, void* out, int64_t T, int64_t I) {
#pragma omp parallel for if (T >= PAR_ROWS)
    for (int64_t t = 0; t < T; t++) {
        const int64_t g = t * 2 * I, o = t * I;
        for (int64_t i = 0; i < I; i++) {
            const float x = load_elem(dtype, gu, g + i);
            const float s = as_dtype(dtype, x / (1.f + exp_f32(-x)));
            store_elem(dtype, out, o + i, s * load_elem(dtype, gu, g + I + i));
        }
    }
}
