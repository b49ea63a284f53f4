/* Decode attention straight over the blocks of a paged KV cache (CPU, OpenMP).
 *
 * One query token per sequence. A work item is a sequence with all its KV heads, or one
 * (sequence, KV head) pair when there are too few sequences for the threads. The G = Hq / Hkv
 * query heads of a KV head share every K and V row read: each row is read once per step, in
 * address order within a block, while the next block is prefetched.
 *
 *   q        [S, Hq, D]            out  [S, Hq, D]
 *   k, v     [N, B, Hkv, D]        one layer's pool: block n, slot o, head h at ((n*B + o)*Hkv + h)*D
 *   tables   [S, W] int64          token t of sequence s sits in block tables[s][t / B], slot t % B
 *   ctx      [S] int64             context length of each sequence (the new token included)
 *
 *   p[g][t] = exp(scale * q[g] . k[t] - max_t) ;  out[g] = sum_t p[g][t] v[t] / sum_t p[g][t]
 *
 * Arithmetic is fp32 throughout; bf16 inputs are widened on load and the output rounded to
 * nearest even, as torch does. Where the CPU has AVX512-BF16 (CHATSTORE_BF16_DOT), bf16 items
 * take paged_decode_bf16.c instead: bf16 dot products, fp32 accumulation, K and V read as stored,
 * with the bf16 prefill item's arithmetic to the bit, so a token gets the same bits whether a step
 * decodes it here or runs it in paged_prefill. Plain C (no torch headers): it builds in seconds.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_bf16.h"
#include "common.h"

typedef struct {
    int dtype;
    const void *k, *v;
    int64_t G, Hkv, D, B;
} Layout;

/* The n slots of one block for KV heads h0 .. h0 + nh as fp32 rows of `*stride` floats: fp32
 * blocks are used in place, bf16 ones widened into `buf` [B, nh, D]. */
INLINE const float* block_f32(const Layout* L, const void* cache, int64_t block, int64_t h0,
                              int64_t nh, int64_t n, float* buf, int64_t* stride) {
    const int64_t at = (block * L->B * L->Hkv + h0) * L->D;
    if (L->dtype == DTYPE_F32) {
        *stride = L->Hkv * L->D;
        return (const float*)cache + at;
    }
    const uint16_t* src = (const uint16_t*)cache + at;
    for (int64_t o = 0; o < n; o++)
        for (int64_t i = 0; i < nh * L->D; i++)
            buf[o * nh * L->D + i] = bf16_to_f32(src[o * L->Hkv * L->D + i]);
    *stride = nh * L->D;
    return buf;
}

/* Blocks ahead of the one computed on whose rows are asked for, slot by slot as that one's are
 * read: a pool's blocks lie anywhere after some churn, and the hardware prefetcher stops at each
 * block's end. The whole next block asked for at once (as before) left most requests waiting for
 * a free miss buffer; one block ahead slot by slot is too late where bf16 blocks are widened
 * whole before use. 30 layers' KV from DRAM, one layer, Zen 5, 2 threads, 9/3 heads: avx2 fp32
 * b8 at 5K 3.0 -> 1.7 ms in order, 3.8 -> 2.4 scattered; avx512 bf16 widened 2.3 -> 1.8
 * scattered, b1 unchanged. */
#define PF_AHEAD 2

/* Ask for slot o of block j of the sequence (KV heads h0 .. h0 + nh), when it has one. */
INLINE void prefetch_slot(const Layout* L, const void* cache, const int64_t* table, int64_t j,
                          int64_t num_blocks, int64_t o, int64_t h0, int64_t nh) {
    if (j >= num_blocks) return;
    const int64_t elem = L->dtype == DTYPE_F32 ? 4 : 2, row = nh * L->D * elem;
    const char* at = (const char*)cache + ((table[j] * L->B + o) * L->Hkv + h0) * L->D * elem;
    for (int64_t c = 0; c < row; c += 64) __builtin_prefetch(at + c);
}

/* a . b in 16 lanes, summed as a tree: no serial chain of horizontal adds. */
INLINE float dot(const float* a, const float* b, const int64_t D) {
    float lanes[16] = {0};
    int64_t d = 0;
    for (; d + 16 <= D; d += 16)
        for (int i = 0; i < 16; i++) lanes[i] += a[d + i] * b[d + i];
    for (int i = 0; i < 8; i++) lanes[i] += lanes[i + 8];
    for (int i = 0; i < 4; i++) lanes[i] += lanes[i + 4];
    float s = (lanes[0] + lanes[2]) + (lanes[1] + lanes[3]);
    for (; d < D; d++) s += a[d] * b[d];
    return s;
}

/* One work item: the nh KV heads from h0 of one sequence, i.e. query heads i = h0 G .. with
 * qg [nh G, D] (scaled) -> acc [nh G, D]. Block by block, as each block is contiguous:
 *   pass 1  scores[i, t] = qg[i] . k[t, h(i)]        pass 2  softmax over t, in place
 *   pass 3  acc[i] = sum_t p[i, t] v[t, h(i)]        (each acc row stays in registers a block) */
INLINE void run_item_d(const Layout* L, const float* qg, const int64_t* table, int64_t ctx,
                       int64_t h0, int64_t nh, float* scores, float* acc, float* buf,
                       const int64_t D) {
    const int64_t G = L->G, B = L->B, rows = nh * G, num_blocks = (ctx + B - 1) / B;
    int64_t stride;
    for (int64_t j = 0, t0 = 0; t0 < ctx; j++, t0 += B) {
        const int64_t n = ctx - t0 < B ? ctx - t0 : B;
        const float* kb = block_f32(L, L->k, table[j], h0, nh, n, buf, &stride);
        for (int64_t o = 0; o < n; o++) { /* slot by slot: the block is read in address order */
            prefetch_slot(L, L->k, table, j + PF_AHEAD, num_blocks, o, h0, nh);
            for (int64_t h = 0; h < nh; h++)
                for (int64_t i = h * G; i < (h + 1) * G; i++)
                    scores[i * ctx + t0 + o] = dot(qg + i * D, kb + o * stride + h * D, D);
        }
    }
    for (int64_t i = 0; i < rows; i++) {
        float* si = scores + i * ctx;
        float m = si[0], sum = 0.f;
#pragma omp simd reduction(max : m)
        for (int64_t t = 1; t < ctx; t++) m = si[t] > m ? si[t] : m;
        for (int64_t t = 0; t < ctx; t++) si[t] = exp_f32(si[t] - m);
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < ctx; t++) sum += si[t];
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < ctx; t++) si[t] *= inv;
    }
    memset(acc, 0, sizeof(float) * rows * D);
    for (int64_t j = 0, t0 = 0; t0 < ctx; j++, t0 += B) {
        const int64_t n = ctx - t0 < B ? ctx - t0 : B;
        const float* vb = block_f32(L, L->v, table[j], h0, nh, n, buf, &stride);
        for (int64_t i = 0; i < rows; i++) {
            const float* vr = vb + i / G * D;
            const float* p = scores + i * ctx + t0;
            float a[D];
            for (int64_t d = 0; d < D; d++) a[d] = acc[i * D + d];
            for (int64_t o = 0; o < n; o++) {
                if (i == 0) prefetch_slot(L, L->v, table, j + PF_AHEAD, num_blocks, o, h0, nh);
                for (int64_t d = 0; d < D; d++) a[d] += p[o] * vr[o * stride + d];
            }
            for (int64_t d = 0; d < D; d++) acc[i * D + d] = a[d];
        }
    }
}

/* Head sizes 64 and 128 get their own copies, with D a constant the compiler unrolls. */
static void run_item(const Layout* L, const float* qg, const int64_t* table, int64_t ctx,
                     int64_t h0, int64_t nh, float* scores, float* acc, float* buf) {
    if (L->D == 64)
        run_item_d(L, qg, table, ctx, h0, nh, scores, acc, buf, 64);
    else if (L->D == 128)
        run_item_d(L, qg, table, ctx, h0, nh, scores, acc, buf, 128);
    else
        run_item_d(L, qg, table, ctx, h0, nh, scores, acc, buf, L->D);
}

/* dtype: 0 = float32, 1 = bfloat16. Returns 0, or -1 when a scratch buffer cannot be allocated.
 *
 * A work item is one sequence with all its KV heads (rows read whole and in order) when there are
 * enough sequences to keep every thread busy, else one (sequence, KV head) pair. */
int paged_decode(int dtype, const void* q, const void* k, const void* v, const int64_t* tables,
                 int64_t table_width, const int64_t* ctx_lens, int64_t S, int64_t Hq, int64_t Hkv,
                 int64_t D, int64_t B, float scale, void* out, int nthreads) {
    const Layout L = {dtype, k, v, Hq / Hkv, Hkv, D, B};
    const int64_t nh = S >= 2 * (int64_t)nthreads ? Hkv : 1; /* KV heads an item covers */
    const int64_t rows = nh * L.G;                           /* query heads an item covers */
    int64_t max_ctx = 1;
    for (int64_t s = 0; s < S; s++) max_ctx = ctx_lens[s] > max_ctx ? ctx_lens[s] : max_ctx;
    size_t bytes = sizeof(float) * (size_t)(rows * max_ctx + 2 * rows * D + B * nh * D);
#if CHATSTORE_BF16_DOT
    const int bf16_dot = dtype == DTYPE_BF16 && D % 16 == 0; /* as paged_prefill's */
    const Bf16Attention A = {q, k, v, out, Hq, Hkv, L.G, D, B, Hq * D, scale};
    if (bf16_dot) bytes = decode_bf16_scratch_bytes(D);
#endif
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        float* scratch = aligned_alloc(64, (bytes + 63) / 64 * 64);
        failed |= scratch == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < S * (Hkv / nh); item++) {
            if (!scratch) continue;
            const int64_t s = item / (Hkv / nh), h0 = item % (Hkv / nh) * nh;
            const int64_t q_off = (s * Hq + h0 * L.G) * D, ctx = ctx_lens[s];
            const int64_t* table = tables + s * table_width;
#if CHATSTORE_BF16_DOT
            if (bf16_dot) {
                decode_item_bf16(&A, table, s, ctx, h0, nh, scratch);
                continue;
            }
#endif
            float* scores = scratch;
            float* qg = scores + rows * max_ctx;
            float* acc = qg + rows * D;
            float* buf = acc + rows * D;
            for (int64_t i = 0; i < rows * D; i++) {
                qg[i] = scale * (dtype == DTYPE_BF16 ? bf16_to_f32(((const uint16_t*)q)[q_off + i])
                                                     : ((const float*)q)[q_off + i]);
            }
            run_item(&L, qg, table, ctx, h0, nh, scores, acc, buf);
            for (int64_t i = 0; i < rows * D; i++) {
                if (dtype == DTYPE_BF16)
                    ((uint16_t*)out)[q_off + i] = f32_to_bf16(acc[i]);
                else
                    ((float*)out)[q_off + i] = acc[i];
            }
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}
