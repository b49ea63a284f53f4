/* The AVX512-BF16 path of the paged-decode kernel (paged_decode.c): the same work items and the
 * same three passes over a sequence's blocks, with both products as bf16 dot products
 * (VDPBF16PS: pairs of bf16 products, exact in fp32, accumulated in fp32) on K and V as stored.
 *
 *   pass 1  scores[i, t] = scale * q[i] . k[t]   32 dims a dot product; 16 keys' 16-lane
 *                                                partial sums reduced together (hsum16)
 *   pass 2  softmax over t in fp32 (the fp32 path's code), then P rounded to bf16: a row of P is
 *           then contiguous bf16, and the pair (P[t], P[t+1]) one 32-bit word
 *   pass 3  acc[i] += dot(bcast(P pair), VI)     VI: V rows t, t+1 interleaved per dim, once per
 *                                                block and KV head, shared by the G query heads
 *
 * Needs an even block size (pairs never straddle blocks) and D a multiple of 16; paged_decode
 * takes its fp32 path otherwise. Built only where CHATSTORE_BF16_DOT is 1.
 */
#include <stdint.h>

#include "attention_bf16.h"
#include "common.h"

#if CHATSTORE_BF16_DOT

/* Row length of the scores and P scratch: room for P[ctx] = 0 (the partner of an odd last key)
 * and whole 32-wide conversions. */
INLINE int64_t ctx_pad(int64_t max_ctx) { return (max_ctx + 32) / 32 * 32; }

size_t decode_bf16_scratch_bytes(int64_t rows, int64_t max_ctx, int64_t D, int64_t B) {
    /* scores [rows][pad] fp32, P [rows][pad] bf16, acc [rows][D] fp32, VI [B/2][D] pairs */
    return (size_t)(rows * ctx_pad(max_ctx) * 6 + rows * D * 4 + (B / 2 + 1) * D * 4);
}

/* Lane j of the result: the sum of v[j]'s 16 lanes. Halves are added level by level (256, 128,
 * 64, 32 bits), two vectors into one each time, then one permute puts the sums in order. */
INLINE __m512 hsum16(const __m512 v[16]) {
    __m512 b[8], c[4], d[2];
    for (int j = 0; j < 8; j++)
        b[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0xEE));
    for (int j = 0; j < 4; j++)
        c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0xDD));
    for (int j = 0; j < 2; j++)
        d[j] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * j], c[2 * j + 1], 0x44),
                             _mm512_shuffle_ps(c[2 * j], c[2 * j + 1], 0xEE));
    const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88),
                                   _mm512_shuffle_ps(d[0], d[1], 0xDD));
    /* lane 4k + m now holds the sum of v[k + 4m] */
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, e);
}

/* 32 (or, at the tail, 16) bf16 of a row; lanes past D are zero. */
INLINE __m512i load_dims(const uint16_t* p, int64_t d, const int64_t D) {
    return D - d >= 32 ? _mm512_loadu_si512(p + d) : _mm512_maskz_loadu_epi16(0xFFFFu, p + d);
}

/* dst[o] = scale * q . k[o] for the n keys of a block, rows k + o * stride. */
INLINE void qk_row(const uint16_t* q, const uint16_t* k, int64_t stride, int64_t n, float scale,
                   float* dst, const int64_t D) {
    for (int64_t o0 = 0; o0 < n; o0 += 16) {
        const int64_t m = n - o0 < 16 ? n - o0 : 16;
        __m512 acc[16];
        for (int64_t o = 0; o < 16; o++) {
            acc[o] = _mm512_setzero_ps();
            if (o >= m) continue;
            const uint16_t* kr = k + (o0 + o) * stride;
            for (int64_t d = 0; d < D; d += 32)
                acc[o] = dot_bf16(acc[o], load_dims(q, d, D), load_dims(kr, d, D));
        }
        const __m512 s = _mm512_mul_ps(hsum16(acc), _mm512_set1_ps(scale));
        _mm512_mask_storeu_ps(dst + o0, (__mmask16)((1u << m) - 1u), s);
    }
}

/* acc [D] += sum over the key pairs p of P pair p (pp[2p], pp[2p + 1]) times VI row p. */
INLINE void pv_row(float* acc, const uint16_t* pp, const uint32_t* vi, int64_t pairs,
                   const int64_t D) {
    __m512 a[D / 16];
    for (int64_t c = 0; c < D / 16; c++) a[c] = _mm512_loadu_ps(acc + 16 * c);
    for (int64_t p = 0; p < pairs; p++) {
        const __m512i w = _mm512_set1_epi32(load_pair(pp + 2 * p));
        for (int64_t c = 0; c < D / 16; c++)
            a[c] = dot_bf16(a[c], w, _mm512_loadu_si512(vi + p * D + 16 * c));
    }
    for (int64_t c = 0; c < D / 16; c++) _mm512_storeu_ps(acc + 16 * c, a[c]);
}

/* Softmax of one row of ctx scores (fp32, as paged_decode.c), then P as bf16 into pb. */
INLINE void softmax_to_bf16(float* si, uint16_t* pb, int64_t ctx) {
    float m = si[0], sum = 0.f;
#pragma omp simd reduction(max : m)
    for (int64_t t = 1; t < ctx; t++) m = si[t] > m ? si[t] : m;
    for (int64_t t = 0; t < ctx; t++) si[t] = exp_f32(si[t] - m);
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < ctx; t++) sum += si[t];
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < ctx; t++) si[t] *= inv;
    for (int64_t t = 0; t < ctx; t += 32) {
        const int64_t left = ctx - t;
        const int64_t nlo = left < 16 ? left : 16, nhi = left < 32 ? left - nlo : 16;
        const __mmask16 lo = (__mmask16)((1u << nlo) - 1u), hi = (__mmask16)((1u << nhi) - 1u);
        const __m512bh p = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, si + t + 16),
                                               _mm512_maskz_loadu_ps(lo, si + t));
        _mm512_storeu_si512(pb + t, (__m512i)p); /* zeros past ctx */
    }
    pb[ctx] = 0; /* the partner of an odd last key, when ctx is a multiple of 32 */
}

INLINE void decode_item_d(const Bf16Attention* A, const int64_t* table, int64_t seq, int64_t ctx,
                          int64_t h0, int64_t nh, int64_t max_ctx, void* scratch,
                          const int64_t D) {
    const int64_t G = A->G, B = A->B, Hkv = A->Hkv, rows = nh * G, pad = ctx_pad(max_ctx);
    const int64_t stride = Hkv * D, num_blocks = (ctx + B - 1) / B, elem_row = stride * 2;
    float* scores = scratch;
    uint16_t* pb = (uint16_t*)(scores + rows * pad);
    float* acc = (float*)(pb + rows * pad);
    uint32_t* vi = (uint32_t*)(acc + rows * D);
    const uint16_t* q = A->q + (seq * A->Hq + h0 * G) * D;
    for (int64_t j = 0, t0 = 0; t0 < ctx; j++, t0 += B) {
        const int64_t n = ctx - t0 < B ? ctx - t0 : B;
        if (j + 1 < num_blocks) /* the next block of K, while this one is computed on */
            for (int64_t o = 0; o < B; o++)
                for (int64_t c = 0; c < nh * D * 2; c += 64)
                    __builtin_prefetch((const char*)(A->k + (table[j + 1] * B * Hkv + h0) * D) +
                                       o * elem_row + c);
        for (int64_t h = 0; h < nh; h++) {
            const uint16_t* kb = A->k + (table[j] * B * Hkv + h0 + h) * D;
            for (int64_t i = h * G; i < (h + 1) * G; i++)
                qk_row(q + i * D, kb, stride, n, A->scale, scores + i * pad + t0, D);
        }
    }
    for (int64_t i = 0; i < rows; i++) softmax_to_bf16(scores + i * pad, pb + i * pad, ctx);
    for (int64_t i = 0; i < rows * D; i++) acc[i] = 0.f;
    for (int64_t j = 0, t0 = 0; t0 < ctx; j++, t0 += B) {
        const int64_t n = ctx - t0 < B ? ctx - t0 : B, pairs = (n + 1) / 2;
        if (j + 1 < num_blocks)
            for (int64_t o = 0; o < B; o++)
                for (int64_t c = 0; c < nh * D * 2; c += 64)
                    __builtin_prefetch((const char*)(A->v + (table[j + 1] * B * Hkv + h0) * D) +
                                       o * elem_row + c);
        for (int64_t h = 0; h < nh; h++) {
            const uint16_t* vb = A->v + (table[j] * B * Hkv + h0 + h) * D;
            for (int64_t p = 0; p < pairs; p++) {
                const uint16_t* odd = 2 * p + 1 < n ? vb + (2 * p + 1) * stride : NULL;
                interleave_rows(vb + 2 * p * stride, odd, vi + p * D, D);
            }
            for (int64_t i = h * G; i < (h + 1) * G; i++) /* t0 is even: B is */
                pv_row(acc + i * D, pb + i * pad + t0, vi, pairs, D);
        }
    }
    uint16_t* out = A->out + (seq * A->Hq + h0 * G) * D;
    for (int64_t i = 0; i < rows * D; i++) out[i] = f32_to_bf16(acc[i]);
}

void decode_item_bf16(const Bf16Attention* A, const int64_t* table, int64_t seq, int64_t ctx,
                      int64_t h0, int64_t nh, int64_t max_ctx, void* scratch) {
    if (A->D == 64)
        decode_item_d(A, table, seq, ctx, h0, nh, max_ctx, scratch, 64);
    else if (A->D == 128)
        decode_item_d(A, table, seq, ctx, h0, nh, max_ctx, scratch, 128);
    else
        decode_item_d(A, table, seq, ctx, h0, nh, max_ctx, scratch, A->D);
}

#endif
