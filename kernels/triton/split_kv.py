"""Split-KV (flash-decoding) for long decode contexts: the reduce, and when to split.

A decode step has one query row per sequence, so the unified kernel's grid is only S x Hkv
programs, each walking its whole context: too few to fill a GPU when S is small and the context
long. With `segments` = G the grid gains a third axis and program (q-block, h, g) covers tiles
g * n .. (g + 1) * n - 1 of its sequence (n = ceil(tiles / G)), writing an unnormalised partial:

    part_out[t, hq, g, :]  sum_j exp(s_j - m_g) v_j      part_max[t, hq, g]  m_g
    part_sum[t, hq, g]     sum_j exp(s_j - m_g)           (m_g = -inf: the slice saw no key)

    out[t, hq] = sum_g exp(m_g - M) part_out[g] / sum_g exp(m_g - M) part_sum[g],  M = max_g m_g

Every segment program of a q-block writes its partial, an empty slice included (m = -inf,
sums 0), so the reduce needs no length and no zeroed buffers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from chatstore.kernels.triton.launch import emulate_bf16, next_pow2, to_dtype

# Split when a decode step's S x Hkv programs would leave most of a GPU's ~132 SMs idle and the
# contexts are long enough for a slice to hold several tiles. Not yet measured on a GPU: vLLM's
# choice (16 segments for decode-only batches), taken as the starting point.
SPLIT_SEGMENTS = 16
SPLIT_MAX_PROGRAMS = 128
SPLIT_MIN_SEQ_LEN = 512


def choose_segments(max_query_len: int, max_seq_len: int, programs: int) -> int:
    """Segments for a step: SPLIT_SEGMENTS for a decode-only step with few, long sequences."""
    if max_query_len == 1 and programs < SPLIT_MAX_PROGRAMS and max_seq_len >= SPLIT_MIN_SEQ_LEN:
        return SPLIT_SEGMENTS
    return 1


class SegmentPartials(NamedTuple):
    out: torch.Tensor  # [T, Hq, G, HEAD_P2] fp32
    max: torch.Tensor  # [T, Hq, G] fp32
    sum: torch.Tensor  # [T, Hq, G] fp32

    @classmethod
    def empty(
        cls, tokens: int, heads: int, segments: int, head_p2: int, device: torch.device
    ) -> SegmentPartials:
        """Buffers for `segments` > 1; one-element placeholders otherwise (never read)."""
        if segments == 1:
            tokens = heads = head_p2 = 1
        if segments != next_pow2(segments):
            raise ValueError(f"segments must be a power of two, got {segments}")
        f32 = torch.float32
        return cls(
            out=torch.empty((tokens, heads, segments, head_p2), dtype=f32, device=device),
            max=torch.empty((tokens, heads, segments), dtype=f32, device=device),
            sum=torch.empty((tokens, heads, segments), dtype=f32, device=device),
        )


@triton.jit
def reduce_segments_kernel(
    out_ptr,  # [T, Hq, D]
    part_out_ptr,  # [T, Hq, SEGMENTS, HEAD_P2]
    part_max_ptr,  # [T, Hq, SEGMENTS]
    part_sum_ptr,  # [T, Hq, SEGMENTS]
    num_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_P2: tl.constexpr,
    SEGMENTS: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_g = tl.arange(0, SEGMENTS)
    offs_d = tl.arange(0, HEAD_P2)
    part = (token * num_heads + head) * SEGMENTS + offs_g  # [SEGMENTS]
    m = tl.load(part_max_ptr + part)
    top = tl.max(m, axis=0)  # finite: segment 0 always holds key 0
    weight = tl.exp(m - top)  # 0 for a segment that saw no key
    denom = tl.sum(weight * tl.load(part_sum_ptr + part), axis=0)
    acc = tl.load(part_out_ptr + part[:, None] * HEAD_P2 + offs_d[None, :])  # [SEGMENTS, HEAD_P2]
    out = tl.sum(acc * weight[:, None], axis=0) / denom
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_d,
        to_dtype(out, out_ptr.dtype.element_ty, EMULATE_BF16),
        mask=offs_d < HEAD_DIM,
    )


def reduce_segments(out: torch.Tensor, parts: SegmentPartials) -> None:
    """Merge the partials into out [T, Hq, D] in place."""
    tokens, heads, segments, head_p2 = parts.out.shape
    reduce_segments_kernel[(tokens, heads)](
        out,
        parts.out,
        parts.max,
        parts.sum,
        heads,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=out.shape[2],
        HEAD_P2=head_p2,
        SEGMENTS=segments,
        EMULATE_BF16=emulate_bf16(out.dtype),
    )
