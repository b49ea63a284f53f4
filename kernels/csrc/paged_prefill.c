/* Causal attention of a step's new tokens over a paged KV cache, read in place (CPU, OpenMP).
 *
 * Any mix of sequences: fresh prompts, new turns on top of pooled history, single decode
 * tokens. Sequence s has q_len[s] new tokens, the last of ctx_len[s] tokens whose K, V are in
 * its blocks (the step's own K, V already written there):
 *
 *   q        [T, Hq, D]          rows q_start[s] .. q_start[s] + q_len[s] of sequence s
 *   k, v     [N, B, Hkv, D]      one layer's pool; token t of s in block tables[s][t / B]
 *   new token i of s sits at position ctx_len[s] - q_len[s] + i and sees keys 0 .. position
 *
 * A work item is (sequence, KV head, tile of up to TILE new tokens): its TILE * G query rows
 * (G = Hq / Hkv heads share the KV head) stream the keys once, in chunks of up to 16 slots of
 * one block. Per chunk: S = Q K^T by broadcast FMAs over a transposed K chunk, an online
 * softmax (running max and sum per row, flash-attention style), O += P V. Keys past a row's
 * position are masked; chunks no row of the tile can see are never read.
 * Arithmetic is fp32; bf16 K, V are widened per chunk and the output rounded once.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "common.h"

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));
/* The same vector at any address: fp32 V rows are read in place, 4-byte aligned. */
typedef float v16u __attribute__((vector_size(64), aligned(4)));

#define TILE 32  /* new tokens per work item */
#define CHUNK 16 /* keys per chunk: one v16 of scores */
#define ROWS 8   /* query rows computed together: 8 independent FMA chains */

typedef struct {
    int dtype;
    const void *k, *v;
    int64_t Hq, Hkv, G, D, B;
} Pool;

/* exp of 16 lanes (the polynomial of exp_f32 in common.h), lanes below -87 give 0. */
INLINE v16 exp_v16(v16 x) {
    const i16 under = x < -87.f; /* comparisons give 0 / -1 lanes */
    v16 xc = (v16)(((i16)x & ~under) | ((i16)((v16){0} - 87.f) & under));
    const i16 over = xc > 88.f;
    xc = (v16)(((i16)xc & ~over) | ((i16)((v16){0} + 88.f) & over));
    const v16 n = (xc * 1.44269504088896341f + 12582912.f) - 12582912.f;
    const v16 r = xc - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    v16 p = (v16){0} + 1.f / 5040.f;
    p = p * r + 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    const i16 bits = (__builtin_convertvector(n, i16) + 127) << 23;
    return (v16)((i16)(p * (v16)bits) & ~under);
}

/* Keys o0 .. o0 + n of one block for KV head h: K transposed into kt [D][16] (zero padded);
 * V as fp32 rows: in place for fp32 (*vstride = Hkv D), else widened into vb [16][D]. */
static const float* load_chunk(const Pool* P, int64_t block, int64_t o0, int64_t n, int64_t h,
                               float* kt, float* vb, int64_t* vstride) {
    const int64_t D = P->D, row = P->Hkv * D;
    const int64_t at = ((block * P->B + o0) * P->Hkv + h) * D;
    if (P->dtype == DTYPE_F32) {
        const float* k = (const float*)P->k + at;
        for (int64_t o = 0; o < n; o++)
            for (int64_t d = 0; d < D; d++) kt[d * CHUNK + o] = k[o * row + d];
    } else {
        const uint16_t* k = (const uint16_t*)P->k + at;
        const uint16_t* v = (const uint16_t*)P->v + at;
        for (int64_t o = 0; o < n; o++)
            for (int64_t d = 0; d < D; d++) {
                kt[d * CHUNK + o] = bf16_to_f32(k[o * row + d]);
                vb[o * D + d] = bf16_to_f32(v[o * row + d]);
            }
    }
    for (int64_t o = n; o < CHUNK; o++)
        for (int64_t d = 0; d < D; d++) kt[d * CHUNK + o] = 0.f;
    if (P->dtype == DTYPE_F32) {
        *vstride = row;
        return (const float*)P->v + at;
    }
    *vstride = D;
    return vb;
}

/* ROWS query rows against one chunk of n keys: scores, online softmax update, P V.
 * visible[r] = how many of the chunk's keys row r may see (0 .. n); l is kept per lane. */
INLINE void rows_chunk(const float* q, const float* kt, const float* vr, int64_t vstride,
                       int64_t n, const int* visible, float* m, v16* l, float* acc,
                       const int64_t D) {
    static const i16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    v16 s[ROWS];
    for (int r = 0; r < ROWS; r++) s[r] = (v16){0};
    for (int64_t d = 0; d < D; d++) {
        const v16 k = *(const v16*)(kt + d * CHUNK);
        for (int r = 0; r < ROWS; r++) s[r] += q[r * D + d] * k;
    }
    v16 p[ROWS];
    float corr[ROWS];
    for (int r = 0; r < ROWS; r++) {
        const i16 seen = lane < visible[r];
        const v16 x = (v16)(((i16)s[r] & seen) | ((i16)((v16){0} - INFINITY) & ~seen));
        float mx = m[r];
        for (int o = 0; o < CHUNK; o++) mx = x[o] > mx ? x[o] : mx;
        if (visible[r] <= 0) { /* nothing to see: p = 0, state unchanged */
            p[r] = (v16){0};
            corr[r] = 1.f;
            continue;
        }
        corr[r] = exp_f32(m[r] - mx); /* 0 on a row's first chunk (m = -inf) */
        p[r] = (v16)((i16)exp_v16(x - mx) & seen);
        l[r] = l[r] * corr[r] + p[r];
        m[r] = mx;
    }
    for (int64_t d = 0; d < D; d += 16) {
        v16 a[ROWS];
        for (int r = 0; r < ROWS; r++) a[r] = *(v16*)(acc + r * D + d) * corr[r];
        for (int64_t o = 0; o < n; o++) {
            const v16 vv = *(const v16u*)(vr + o * vstride + d);
            for (int r = 0; r < ROWS; r++) a[r] += p[r][o] * vv;
        }
        for (int r = 0; r < ROWS; r++) *(v16*)(acc + r * D + d) = a[r];
    }
}

static void rows_chunk_any(const float* q, const float* kt, const float* vr, int64_t vstride,
                           int64_t n, const int* visible, float* m, v16* l, float* acc,
                           int64_t D) {
    if (D == 64)
        rows_chunk(q, kt, vr, vstride, n, visible, m, l, acc, 64);
    else if (D == 128)
        rows_chunk(q, kt, vr, vstride, n, visible, m, l, acc, 128);
    else
        rows_chunk(q, kt, vr, vstride, n, visible, m, l, acc, D);
}

/* D must be a multiple of 16 (checked by the caller). Returns 0, or -1 when scratch memory
 * cannot be allocated. */
int paged_prefill(int dtype, const void* q, const void* k, const void* v, const int64_t* tables,
                  int64_t table_width, const int64_t* q_start, const int64_t* q_len,
                  const int64_t* ctx_len, int64_t S, int64_t Hq, int64_t Hkv, int64_t D,
                  int64_t B, float scale, void* out, int nthreads) {
    const Pool P = {dtype, k, v, Hq, Hkv, Hq / Hkv, D, B};
    const int64_t G = P.G;
    /* Work items: (sequence, tile) pairs, each for every KV head. */
    int64_t* item_seq = malloc(sizeof(int64_t) * (size_t)(S + 1));
    if (!item_seq) return -1;
    int64_t tiles = 0;
    for (int64_t s = 0; s < S; s++) {
        item_seq[s] = tiles;
        tiles += (q_len[s] + TILE - 1) / TILE;
    }
    item_seq[S] = tiles;
    const int64_t rows_max = ((TILE * G + ROWS - 1) / ROWS) * ROWS;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        const size_t floats = (size_t)(2 * CHUNK * D + 2 * rows_max * D + 17 * rows_max);
        float* scratch = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        failed |= scratch == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < tiles * Hkv; item++) {
            if (!scratch) continue;
            const int64_t tile = item / Hkv, h = item % Hkv;
            int64_t s = 0; /* the sequence owning this tile: binary search over item_seq */
            for (int64_t lo = 0, hi = S - 1; lo <= hi;) {
                const int64_t mid = (lo + hi) / 2;
                if (item_seq[mid] <= tile) { s = mid; lo = mid + 1; } else hi = mid - 1;
            }
            const int64_t i0 = (tile - item_seq[s]) * TILE;
            const int64_t nt = q_len[s] - i0 < TILE ? q_len[s] - i0 : TILE;
            const int64_t first_pos = ctx_len[s] - q_len[s] + i0;
            const int64_t rows = nt * G, rows_pad = ((rows + ROWS - 1) / ROWS) * ROWS;
            float* kt = scratch;
            float* vb = kt + CHUNK * D;
            float* qs = vb + CHUNK * D;
            float* acc = qs + rows_max * D;
            v16* l = (v16*)(acc + rows_max * D);
            float* m = (float*)(l + rows_max);
            /* Row r = (token i, head g): query head h G + g of new token i0 + i. */
            for (int64_t r = 0; r < rows_pad; r++) {
                m[r] = -INFINITY;
                l[r] = (v16){0};
                for (int64_t d = 0; d < D; d++) acc[r * D + d] = 0.f;
                if (r < rows) {
                    const int64_t i = r / G, g = r % G;
                    const int64_t at = ((q_start[s] + i0 + i) * Hq + h * G + g) * D;
                    for (int64_t d = 0; d < D; d++) qs[r * D + d] = scale * load_elem(dtype, q, at + d);
                } else {
                    for (int64_t d = 0; d < D; d++) qs[r * D + d] = 0.f;
                }
            }
            const int64_t* table = tables + s * table_width;
            const int64_t last_pos = first_pos + nt - 1; /* no row sees past it */
            for (int64_t t0 = 0, n; t0 <= last_pos; t0 += n) {
                const int64_t j = t0 / B, o0 = t0 % B;
                n = last_pos + 1 - t0;
                n = n < CHUNK ? n : CHUNK;
                n = n < B - o0 ? n : B - o0; /* a chunk never crosses a block */
                int64_t vstride;
                const float* vr = load_chunk(&P, table[j], o0, n, h, kt, vb, &vstride);
                for (int64_t r0 = 0; r0 < rows_pad; r0 += ROWS) {
                    int visible[ROWS], any = 0;
                    for (int r = 0; r < ROWS; r++) {
                        const int64_t row = r0 + r;
                        int64_t vis = row < rows ? first_pos + row / G + 1 - t0 : 0;
                        vis = vis < n ? vis : n;
                        visible[r] = vis > 0 ? (int)vis : 0;
                        any |= visible[r];
                    }
                    if (!any) continue; /* causal skip: no row of the group sees this chunk */
                    rows_chunk_any(qs + r0 * D, kt, vr, vstride, n, visible, m + r0, l + r0,
                                   acc + r0 * D, D);
                }
            }
            for (int64_t r = 0; r < rows; r++) {
                const int64_t i = r / G, g = r % G;
                const int64_t at = ((q_start[s] + i0 + i) * Hq + h * G + g) * D;
                float sum = 0.f;
                for (int o = 0; o < CHUNK; o++) sum += l[r][o];
                const float inv = 1.f / sum;
                for (int64_t d = 0; d < D; d++) store_elem(dtype, out, at + d, acc[r * D + d] * inv);
            }
        }
        free(scratch);
    }
    free(item_seq);
    return failed ? -1 : 0;
}
