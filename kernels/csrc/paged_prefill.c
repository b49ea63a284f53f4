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
 * A work item is (sequence, KV head, LANES query rows), a row being (new token i, head g of the
 * G = Hq / Hkv that share the KV head). The rows are the lanes of NV vectors (VL lanes each:
 * 16 with AVX512, 8 with AVX2, see vec.h), so nothing
 * is transposed per key: Q is transposed once per item into QT [D][LANES], then for each chunk of
 * up to 16 keys of one block, read where they lie,
 *
 *   S[o]    = sum_d QT[d] * K[o][d]          (a lane-wise FMA with K[o][d] broadcast)
 *   m, l    running max and sum per lane     (flash attention's online softmax, lane-wise)
 *   OT[d]  += sum_o P[o] * V[o][d]           (V[o][d] broadcast)
 *
 * and the softmax needs no horizontal operation at all. Keys past a lane's position are
 * masked; a chunk past every lane's position is never read. Arithmetic is fp32: bf16 K, V are
 * widened per chunk into a buffer and the output rounded once. Where the CPU has AVX512-BF16
 * (CHATSTORE_BF16_DOT), bf16 items take paged_prefill_bf16.c instead: the same items, chunks
 * and softmax, with bf16 dot products and fp32 accumulation.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "attention_bf16.h"
#include "common.h"
#include "vec.h"

/* Register tiles: QK_KEYS x NV score accumulators, then PV_DIMS x NV output accumulators, sized
 * to the register file (32 zmm with AVX512, 16 ymm/xmm otherwise) so that neither spills, and
 * to the FMA's latency x issue width (4 x 2 on current x86 cores: 8 chains in flight). With 16
 * registers, 6 x 2 = 12 chains leave slack where 4 x 2 ran at the edge: 4-key and 4-dim tiles
 * (8 chains) only finish what a multiple of 6 does not cover (2K causal on AVX2: 34 -> 27 ms). */
#if VL == 16
#define QK_KEYS 8 /* keys whose scores are accumulated together */
#define PV_DIMS 8 /* output dims accumulated together */
#else
#define QK_KEYS 6
#define PV_DIMS 6
#endif

/* Scores of keys o .. o + K against the lanes: K x NV chains over d. */
INLINE void qk_tile(const float* qt, const float* kr, int64_t stride, int64_t o, vf s[][NV],
                    const int K, const int64_t D) {
    vf acc[QK_KEYS][NV];
    for (int j = 0; j < K; j++)
        for (int g = 0; g < NV; g++) acc[j][g] = (vf){0};
    for (int64_t d = 0; d < D; d++) {
        vf q[NV];
        for (int g = 0; g < NV; g++) q[g] = *(const vf*)(qt + (d * NV + g) * VL);
        for (int j = 0; j < K; j++) {
            const float kv = kr[(o + j) * stride + d];
            for (int g = 0; g < NV; g++) acc[j][g] += q[g] * kv;
        }
    }
    for (int j = 0; j < K; j++)
        for (int g = 0; g < NV; g++) s[o + j][g] = acc[j][g];
}

/* Output dims d .. d + J: J x NV chains over the chunk's n keys. */
INLINE void pv_tile(const float* vr, int64_t stride, int64_t n, int64_t d, vf s[][NV],
                    int rescale, const vf* corr, float* ot, const int J) {
    vf a[PV_DIMS][NV];
    for (int j = 0; j < J; j++)
        for (int g = 0; g < NV; g++) {
            a[j][g] = *(vf*)(ot + ((d + j) * NV + g) * VL);
            if (rescale) a[j][g] *= corr[g];
        }
    for (int64_t o = 0; o < n; o++) {
        const float* vo = vr + o * stride + d;
        for (int j = 0; j < J; j++) {
            const float vv = vo[j];
            for (int g = 0; g < NV; g++) a[j][g] += s[o][g] * vv;
        }
    }
    for (int j = 0; j < J; j++)
        for (int g = 0; g < NV; g++) *(vf*)(ot + ((d + j) * NV + g) * VL) = a[j][g];
}

/* One chunk of n keys (rows kr + o * stride, vr + o * stride) against the item's lanes:
 * qt [D][NV][VL], ot [D][NV][VL], pos / m / l one vector per lane group. */
INLINE void chunk_step(const float* qt, const float* kr, const float* vr, int64_t stride,
                       int64_t n, int64_t t0, int64_t min_pos, const vint* pos, vf* m, vf* l,
                       float* ot, const int64_t D) {
    vf s[CHUNK][NV];
    int64_t o = 0;
    for (; o + QK_KEYS <= n; o += QK_KEYS) qk_tile(qt, kr, stride, o, s, QK_KEYS, D);
#if QK_KEYS > 4
    for (; o + 4 <= n; o += 4) qk_tile(qt, kr, stride, o, s, 4, D);
#endif
    for (; o < n; o++) qk_tile(qt, kr, stride, o, s, 1, D);
    vf corr[NV];
    const int rescale = online_softmax(s, n, t0, min_pos, pos, m, l, corr);
    /* D is a multiple of 16: PV_DIMS-wide tiles while what is left stays a sum of PV_DIMS and 4s
     * (with 6s: never 2 left) */
    for (int64_t d = 0; d < D;) {
        if (D - d >= PV_DIMS && D - d - PV_DIMS != 2) {
            pv_tile(vr, stride, n, d, s, rescale, corr, ot, PV_DIMS);
            d += PV_DIMS;
        } else {
            pv_tile(vr, stride, n, d, s, rescale, corr, ot, 4);
            d += 4;
        }
    }
}

static void chunk_step_any(const float* qt, const float* kr, const float* vr, int64_t stride,
                           int64_t n, int64_t t0, int64_t min_pos, const vint* pos, vf* m,
                           vf* l, float* ot, int64_t D) {
    if (D == 64)
        chunk_step(qt, kr, vr, stride, n, t0, min_pos, pos, m, l, ot, 64);
    else if (D == 128)
        chunk_step(qt, kr, vr, stride, n, t0, min_pos, pos, m, l, ot, 128);
    else
        chunk_step(qt, kr, vr, stride, n, t0, min_pos, pos, m, l, ot, D);
}

/* D must be a multiple of 16 (checked by the caller). q_stride: elements from one token's q row
 * to the next, so q may be the query part of the fused qkv projection, read in place (Hq * D
 * when packed). Returns 0, or -1 when scratch memory cannot be allocated. */
int paged_prefill(int dtype, const void* q, int64_t q_stride, const void* k, const void* v,
                  const int64_t* tables, int64_t table_width, const int64_t* q_start,
                  const int64_t* q_len, const int64_t* ctx_len, int64_t S, int64_t Hq,
                  int64_t Hkv, int64_t D, int64_t B, float scale, void* out, int nthreads) {
    const int64_t G = Hq / Hkv, row_stride = Hkv * D;
    /* Work items: each sequence's groups of LANES rows, for every KV head. */
    int64_t* first_group = malloc(sizeof(int64_t) * (size_t)(S + 1));
    if (!first_group) return -1;
    int64_t groups = 0;
    for (int64_t s = 0; s < S; s++) {
        first_group[s] = groups;
        groups += (q_len[s] * G + LANES - 1) / LANES;
    }
    first_group[S] = groups;
    /* QT and OT [D][LANES], then bf16 chunks widened to K and V [16][D]. */
    size_t bytes = (size_t)(2 * D * LANES + 2 * CHUNK * D) * sizeof(float);
#if CHATSTORE_BF16_DOT
    const int bf16_dot = dtype == DTYPE_BF16;
    const Bf16Attention A = {q, k, v, out, Hq, Hkv, G, D, B, q_stride, scale};
    if (bf16_dot) bytes = prefill_bf16_scratch_bytes(D);
#endif
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        float* scratch = aligned_alloc(64, (bytes + 63) / 64 * 64);
        failed |= scratch == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < groups * Hkv; item++) {
            if (!scratch) continue;
            const int64_t group = item / Hkv, h = item % Hkv;
            int64_t s = 0; /* the sequence owning the group: binary search over first_group */
            for (int64_t lo = 0, hi = S - 1; lo <= hi;) {
                const int64_t mid = (lo + hi) / 2;
                if (first_group[mid] <= group) {
                    s = mid;
                    lo = mid + 1;
                } else {
                    hi = mid - 1;
                }
            }
            const int64_t r0 = (group - first_group[s]) * LANES;
            const int64_t rows = q_len[s] * G - r0 < LANES ? q_len[s] * G - r0 : LANES;
            const int64_t first_pos = ctx_len[s] - q_len[s];
#if CHATSTORE_BF16_DOT
            if (bf16_dot) {
                prefill_item_bf16(&A, tables + s * table_width, q_start[s], h, r0, rows, first_pos,
                                  scratch);
                continue;
            }
#endif
            float* qt = scratch;
            float* ot = qt + D * LANES;
            float* kb = ot + D * LANES;
            float* vb = kb + CHUNK * D;
            vint pos[NV];
            int64_t last_pos = 0;
            for (int lane = 0; lane < LANES; lane++) {
                const int64_t r = r0 + lane, i = r / G, g = r % G;
                /* -1: a padding lane, which sees nothing */
                pos[lane / VL][lane % VL] = lane < rows ? (int32_t)(first_pos + i) : -1;
                last_pos = lane < rows ? first_pos + i : last_pos;
                const int64_t at = (q_start[s] + i) * q_stride + (h * G + g) * D;
                for (int64_t d = 0; d < D; d++) {
                    qt[d * LANES + lane] = lane < rows ? scale * load_elem(dtype, q, at + d) : 0.f;
                    ot[d * LANES + lane] = 0.f;
                }
            }
            vf m[NV], l[NV];
            for (int g = 0; g < NV; g++) {
                m[g] = splat(-INFINITY);
                l[g] = (vf){0};
            }
            const int64_t* table = tables + s * table_width;
            const int64_t min_pos = first_pos + r0 / G; /* lane 0's: rows go up in position */
            for (int64_t t0 = 0, n; t0 <= last_pos; t0 += n) {
                const int64_t o0 = t0 % B;
                n = last_pos + 1 - t0;
                n = n < CHUNK ? n : CHUNK;
                n = n < B - o0 ? n : B - o0; /* a chunk never crosses a block */
                const int64_t at = ((table[t0 / B] * B + o0) * Hkv + h) * D;
                const float *kr, *vr;
                int64_t stride;
                if (dtype == DTYPE_F32) {
                    kr = (const float*)k + at;
                    vr = (const float*)v + at;
                    stride = row_stride;
                } else {
                    for (int64_t o = 0; o < n; o++)
                        for (int64_t d = 0; d < D; d++) {
                            kb[o * D + d] = bf16_to_f32(((const uint16_t*)k)[at + o * row_stride + d]);
                            vb[o * D + d] = bf16_to_f32(((const uint16_t*)v)[at + o * row_stride + d]);
                        }
                    kr = kb;
                    vr = vb;
                    stride = D;
                }
                chunk_step_any(qt, kr, vr, stride, n, t0, min_pos, pos, m, l, ot, D);
            }
            for (int lane = 0; lane < rows; lane++) {
                const int64_t r = r0 + lane, i = r / G, g = r % G;
                const int64_t at = ((q_start[s] + i) * Hq + h * G + g) * D;
                const float inv = 1.f / l[lane / VL][lane % VL];
                for (int64_t d = 0; d < D; d++)
                    store_elem(dtype, out, at + d, ot[d * LANES + lane] * inv);
            }
        }
        free(scratch);
    }
    free(first_group);
    return failed ? -1 : 0;
}
