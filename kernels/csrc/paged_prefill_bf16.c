/* The AVX512-BF16 path of the paged-prefill kernel (paged_prefill.c): the same work items and
 * chunks, an fp32 online softmax in base 2 (online_softmax_bf16), and both products as bf16 dot
 * products (VDPBF16PS: pairs of bf16 products, exact in fp32, accumulated in fp32) instead of
 * fp32 FMAs over K and V widened into a buffer.
 *
 *   QK^T  the 32 query rows sit in the lanes as bf16 pairs along d, QT2[d/2][lane] =
 *         (q[lane][d], q[lane][d+1]); key o's pair (k[o][d], k[o][d+1]) is one 32-bit word of
 *         the K row as stored, broadcast: S[o] += dot(QT2[d/2], bcast(k[o][d:d+2])). No widening,
 *         half the instructions of the fp32 FMAs; q and S unscaled (exact), the scale folded
 *         into the softmax's base-2 exponent (online_softmax_bf16).
 *   PV    pairs along the key index: P[o], P[o+1] (fp32 after the softmax) rounded to bf16 and
 *         interleaved per lane, V rows o and o+1 interleaved per dim once per chunk:
 *         OT[d] += dot(P2[o/2], bcast(VI[o/2][d])).
 *
 * P rounded to bf16 before PV is what bf16 flash attention does (torch's CPU kernel included); the
 * softmax, its max and its sum stay fp32, its exponential 2^x by a degree-3 polynomial (relative
 * error < 7.5e-5, under bf16's 2^-9: attention_bf16.h's exp2_bf16). Q goes into the lanes and
 * the output back to rows by 16 x 16 register transposes. Built only where CHATSTORE_BF16_DOT
 * is 1.
 */
#include <math.h>
#include <stdint.h>

#include "attention_bf16.h"
#include "vec.h"

#if CHATSTORE_BF16_DOT

_Static_assert(VL == 16, "the bf16 dot-product path is written for 512-bit lane vectors");

#define QK_KEYS 8 /* keys whose scores are accumulated together */
#define PV_DIMS 8 /* output dims accumulated together */

size_t prefill_bf16_scratch_bytes(int64_t D) {
    /* QT2 [D/2][LANES] pairs, OT [D][LANES] fp32, VI [CHUNK/2][D] pairs */
    return (size_t)(D / 2 * LANES + D * LANES + CHUNK / 2 * D) * 4;
}

/* bf16(a[l]) and bf16(b[l]) side by side in 32-bit lane l: two keys' probabilities as a pair. */
INLINE __m512i pair_lanes(vf a, vf b) {
    static const uint16_t order[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,
                                       21, 6,  22, 7,  23, 8,  24, 9,  25, 10, 26,
                                       11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i halves = (__m512i)_mm512_cvtne2ps_pbh((__m512)b, (__m512)a); /* [a | b] */
    return _mm512_permutexvar_epi16(_mm512_loadu_si512(order), halves);
}

/* A chunk whose scores wait for their exponentials, which are taken one key at a time between
 * the next chunk's QK^T dot products: the exponentials' instructions then run beside the dot
 * products instead of holding the vector units alone. Keys in order, so each lane vector's sum
 * is online_softmax_bf16's to the bit (decode runs that one). */
typedef struct {
    vf (*s)[NV];        /* the chunk's scores [CHUNK][NV]: raw, then probabilities */
    int64_t n, done;    /* its keys; keys exponentiated so far */
    const uint16_t* vr; /* its V rows */
    vf nb[NV], sum[NV], corr[NV];
    int rescale;
    float c;
} PendingChunk;

INLINE void pending_key(PendingChunk* pc) {
    const int64_t o = pc->done++;
    for (int g = 0; g < NV; g++) {
        pc->s[o][g] = softmax_p_bf16(pc->s[o][g], pc->nb[g], pc->c);
        pc->sum[g] += pc->s[o][g];
    }
}

/* Raw scores s[o] = q.k[o] of n keys (rows kr + o * stride) for the item's lanes, with pc's
 * pending exponentials taken along the way, one key every other pair index (every one, or every
 * fourth, measured no better), all of them by the return. */
INLINE void qk_chunk(const uint32_t* qt2, const uint16_t* kr, int64_t stride, int64_t n,
                     vf s[CHUNK][NV], PendingChunk* pc, const int64_t D) {
    int64_t o = 0;
    for (; o + QK_KEYS <= n; o += QK_KEYS) {
        __m512 acc[QK_KEYS][NV];
        for (int j = 0; j < QK_KEYS; j++)
            for (int g = 0; g < NV; g++) acc[j][g] = _mm512_setzero_ps();
        for (int64_t e = 0; e < D / 2; e++) {
            __m512i q[NV];
            for (int g = 0; g < NV; g++) q[g] = _mm512_load_si512(qt2 + (e * NV + g) * 16);
            for (int j = 0; j < QK_KEYS; j++) {
                const __m512i kp = _mm512_set1_epi32(load_pair(kr + (o + j) * stride + 2 * e));
                for (int g = 0; g < NV; g++) acc[j][g] = dot_bf16(acc[j][g], q[g], kp);
            }
            if ((e & 1) && pc->done < pc->n) pending_key(pc);
        }
        for (int j = 0; j < QK_KEYS; j++)
            for (int g = 0; g < NV; g++) s[o + j][g] = (vf)acc[j][g];
    }
    for (; o < n; o++) {
        __m512 acc[NV];
        for (int g = 0; g < NV; g++) acc[g] = _mm512_setzero_ps();
        for (int64_t e = 0; e < D / 2; e++) {
            const __m512i kp = _mm512_set1_epi32(load_pair(kr + o * stride + 2 * e));
            for (int g = 0; g < NV; g++)
                acc[g] = dot_bf16(acc[g], _mm512_load_si512(qt2 + (e * NV + g) * 16), kp);
        }
        for (int g = 0; g < NV; g++) s[o][g] = (vf)acc[g];
    }
    while (pc->done < pc->n) pending_key(pc);
}

/* The pending chunk's sums into l, and its PV into OT (rescaled by its corr first). */
INLINE void pv_chunk(const PendingChunk* pc, int64_t stride, vf* l, float* ot, uint32_t* vi,
                     const int64_t D) {
    for (int g = 0; g < NV; g++) l[g] = softmax_sum_bf16(l[g], pc->corr[g], pc->sum[g]);
    const int64_t n = pc->n;
    const uint16_t* vr = pc->vr;
    /* Pairs of keys (2p, 2p + 1); an odd chunk's last key pairs with a zero key (P = 0, V = 0:
     * the row past the chunk is never read). */
    const int64_t pairs = (n + 1) / 2;
    __m512i pp[CHUNK / 2][NV];
    for (int64_t p = 0; p < pairs; p++) {
        const int has_odd = 2 * p + 1 < n;
        for (int g = 0; g < NV; g++)
            pp[p][g] = pair_lanes(pc->s[2 * p][g], has_odd ? pc->s[2 * p + 1][g] : splat(0.f));
        interleave_rows(vr + 2 * p * stride, has_odd ? vr + (2 * p + 1) * stride : NULL,
                        vi + p * D, D);
    }
    for (int64_t d = 0; d < D; d += PV_DIMS) {
        __m512 a[PV_DIMS][NV];
        for (int j = 0; j < PV_DIMS; j++)
            for (int g = 0; g < NV; g++) {
                a[j][g] = _mm512_load_ps(ot + ((d + j) * NV + g) * 16);
                if (pc->rescale) a[j][g] = _mm512_mul_ps(a[j][g], (__m512)pc->corr[g]);
            }
        for (int64_t p = 0; p < pairs; p++)
            for (int j = 0; j < PV_DIMS; j++) {
                const __m512i vp = _mm512_set1_epi32((int32_t)vi[p * D + d + j]);
                for (int g = 0; g < NV; g++) a[j][g] = dot_bf16(a[j][g], pp[p][g], vp);
            }
        for (int j = 0; j < PV_DIMS; j++)
            for (int g = 0; g < NV; g++) _mm512_store_ps(ot + ((d + j) * NV + g) * 16, a[j][g]);
    }
}

/* pv_chunk for one D, out of line: inlined into item_chunks' loop beside qk_chunk, gcc kept the
 * pairs of P in one register stored to and reloaded from the stack for every dot product (the
 * kernel ran 35 % slower). */
#define PV_CHUNK_OF(DIM)                                                                        \
    static __attribute__((noinline)) void pv_chunk_##DIM(const PendingChunk* pc, int64_t stride, \
                                                         vf* l, float* ot, uint32_t* vi) {      \
        pv_chunk(pc, stride, l, ot, vi, DIM);                                                    \
    }
PV_CHUNK_OF(64)
PV_CHUNK_OF(128)

static __attribute__((noinline)) void pv_chunk_any(const PendingChunk* pc, int64_t stride, vf* l,
                                                   float* ot, uint32_t* vi, int64_t D) {
    if (D == 64)
        pv_chunk_64(pc, stride, l, ot, vi);
    else if (D == 128)
        pv_chunk_128(pc, stride, l, ot, vi);
    else
        pv_chunk(pc, stride, l, ot, vi, D);
}

/* The item's chunks of keys, each at most CHUNK and never across a block, software-pipelined:
 * QK^T of chunk i (with chunk i - 1's exponentials between its dot products), then chunk i - 1's
 * PV, then chunk i's mask, max and correction. The same arithmetic per lane, in the same order,
 * as online_softmax_bf16 chunk after chunk. */
INLINE void item_chunks(const Bf16Attention* A, const int64_t* table, int64_t h,
                        const uint32_t* qt2, int64_t last_pos, int64_t min_pos, const vint* pos,
                        vf* m, vf* l, float* ot, uint32_t* vi, const int64_t D) {
    const int64_t B = A->B, stride = A->Hkv * D;
    vf scores[2][CHUNK][NV];
    PendingChunk pc = {.s = scores[1], .n = 0, .done = 0, .c = softmax_exp2_scale(A->scale)};
    int cur = 0;
    for (int64_t t0 = 0, n; t0 <= last_pos; t0 += n) {
        const int64_t o0 = t0 % B;
        n = last_pos + 1 - t0;
        n = n < CHUNK ? n : CHUNK;
        n = n < B - o0 ? n : B - o0; /* a chunk never crosses a block */
        const int64_t at = ((table[t0 / B] * B + o0) * A->Hkv + h) * D;
        qk_chunk(qt2, A->k + at, stride, n, scores[cur], &pc, D);
        if (pc.n) pv_chunk_any(&pc, stride, l, ot, vi, D);
        pc.s = scores[cur];
        pc.n = n;
        pc.done = 0;
        pc.vr = A->v + at;
        pc.rescale = softmax_max_bf16(scores[cur], n, t0, min_pos, pos, m, pc.corr, pc.nb, NV,
                                      pc.c);
        for (int g = 0; g < NV; g++) pc.sum[g] = (vf){0};
        cur ^= 1;
    }
    while (pc.done < pc.n) pending_key(&pc);
    if (pc.n) pv_chunk_any(&pc, stride, l, ot, vi, D);
}

void prefill_item_bf16(const Bf16Attention* A, const int64_t* table, int64_t q_row0, int64_t h,
                       int64_t r0, int64_t rows, int64_t first_pos, void* scratch) {
    const int64_t D = A->D, G = A->G, B = A->B, Hq = A->Hq, Hkv = A->Hkv;
    uint32_t* qt2 = scratch;
    float* ot = (float*)(qt2 + D / 2 * LANES);
    uint32_t* vi = (uint32_t*)(ot + D * LANES);
    vint pos[NV];
    int64_t last_pos = 0;
    const uint16_t* qrows[LANES]; /* the lane's q row; NULL: a padding lane */
    for (int lane = 0; lane < LANES; lane++) {
        const int64_t r = r0 + lane, i = r / G, g = r % G;
        /* -1: a padding lane, which sees nothing */
        pos[lane / 16][lane % 16] = lane < rows ? (int32_t)(first_pos + i) : -1;
        last_pos = lane < rows ? first_pos + i : last_pos;
        qrows[lane] = lane < rows ? A->q + (q_row0 + i) * A->q_stride + (h * G + g) * D : NULL;
    }
    /* QT2[e][lane] = the lane's pair e: 16 lanes x 16 pairs (32 bf16, 64 bytes a row) at a time
     * through a register transpose (scalar, this and the output took a tenth of the kernel). */
    for (int g = 0; g < NV; g++)
        for (int64_t e0 = 0; e0 < D / 2; e0 += 16) {
            const int64_t ne = D / 2 - e0 < 16 ? D / 2 - e0 : 16; /* 8 when D / 16 is odd */
            const __mmask16 part = (__mmask16)((1u << ne) - 1u);
            __m512i t[16];
            for (int k = 0; k < 16; k++) {
                const uint16_t* qr = qrows[g * 16 + k];
                t[k] = qr ? _mm512_maskz_loadu_epi32(part, qr + 2 * e0) : _mm512_setzero_si512();
            }
            transpose16(t);
            for (int k = 0; k < ne; k++) _mm512_store_si512(qt2 + (e0 + k) * LANES + g * 16, t[k]);
        }
    memset(ot, 0, (size_t)(D * LANES) * sizeof(float));
    vf m[NV], l[NV];
    for (int g = 0; g < NV; g++) {
        m[g] = splat(-INFINITY);
        l[g] = (vf){0};
    }
    const int64_t min_pos = first_pos + r0 / G; /* lane 0's: rows go up in position */
    if (D == 64)
        item_chunks(A, table, h, qt2, last_pos, min_pos, pos, m, l, ot, vi, 64);
    else if (D == 128)
        item_chunks(A, table, h, qt2, last_pos, min_pos, pos, m, l, ot, vi, 128);
    else
        item_chunks(A, table, h, qt2, last_pos, min_pos, pos, m, l, ot, vi, D);
    /* out = bf16(OT[d][lane] / l): 16 dims x 16 lanes at a time back to rows by a transpose */
    for (int g = 0; g < NV && g * 16 < rows; g++) {
        float inv[16];
        for (int k = 0; k < 16; k++) inv[k] = 1.f / l[g][k];
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
            __m512i t[16];
            for (int k = 0; k < 16; k++)
                t[k] = _mm512_castps_si512(_mm512_load_ps(ot + (d0 + k) * LANES + g * 16));
            transpose16(t);
            for (int k = 0; k < 16 && g * 16 + k < rows; k++) {
                const int64_t r = r0 + g * 16 + k, i = r / G, hg = r % G;
                uint16_t* dst = A->out + ((q_row0 + i) * Hq + h * G + hg) * D + d0;
                const __m512 o = _mm512_mul_ps(_mm512_castsi512_ps(t[k]), _mm512_set1_ps(inv[k]));
                _mm256_storeu_si256((__m256i*)dst, f32_to_bf16_x16(o));
            }
        }
    }
}

#endif
