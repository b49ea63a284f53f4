/* The AVX512-BF16 path of the paged-decode kernel (paged_decode.c): a decode token is run as a
 * one-token prefill item (paged_prefill_bf16.c), G query heads of a KV head in the lanes.
 *
 * Why not a decode-specific loop: continuous batching runs the same token in the decode kernel in
 * one step and in the prefill kernel in another (a mixed step attends in place), so the two must
 * give the same bits, or greedy tokens depend on the batch. A separate decode loop (dims in lanes
 * and a horizontal sum for QK^T, one softmax over the whole context, P normalised before its
 * rounding to bf16) rounded differently from the prefill item (a sequential pairwise sum per lane,
 * an online softmax over 16-key chunks aligned to key positions and blocks, P unnormalised).
 * Sharing the prefill item's arithmetic makes a token's output independent of its batch, of its
 * lane in an item and of the other rows there (tests/test_kernels_bf16.py pins it bitwise).
 * Built only where CHATSTORE_BF16_DOT is 1.
 */
#include <stdint.h>

#include "attention_bf16.h"
#include "vec16.h"

#if CHATSTORE_BF16_DOT

size_t decode_bf16_scratch_bytes(int64_t D) { return prefill_bf16_scratch_bytes(D); }

void decode_item_bf16(const Bf16Attention* A, const int64_t* table, int64_t seq, int64_t ctx,
                      int64_t h0, int64_t nh, void* scratch) {
    for (int64_t h = h0; h < h0 + nh; h++)
        for (int64_t r0 = 0; r0 < A->G; r0 += LANES) {
            const int64_t rows = A->G - r0 < LANES ? A->G - r0 : LANES;
            prefill_item_bf16(A, table, seq, h, r0, rows, ctx - 1, scratch);
        }
}

#endif
