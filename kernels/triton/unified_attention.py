"""One Triton kernel for the attention of any step: prefill, decode and mixed batches, in place
over the paged pool (the design of vLLM's unified Triton attention, written for our layout).

    q, out        [T, Hq, D]      T = sum(query_lens); sequence i owns rows
                                  query_start[i] .. query_start[i + 1] - 1
    k/v cache     [N, B, Hkv, D]  N blocks of B slots for one layer (K rotated, as the pool holds)
    block_tables  [S, W]          slot p of sequence i: block_tables[i, p // B] * B + p % B
    seq_lens      [S]             each sequence's context, its new tokens included

Grid (T // BLOCK_Q + S, Hkv, segments). A program serves one q-block: BLOCK_Q new tokens of one
sequence times the GROUP query heads that share KV head h, BLOCK_M = BLOCK_Q * GROUP rows of one
tile product (GQA: each K, V tile is read once for the whole group). Sequence i's q-blocks are
the programs from  query_start[i] // BLOCK_Q + i  on; a binary search over query_start finds a
program's sequence, so the grid needs only T and S, and every length is read on the device
(a CUDA graph can capture it). Spare programs return at once.

    BLOCK_Q = 4, query_lens 6 | 1 | 3    query_start 0 6 7 10    grid 10 // 4 + 3 = 5
    program     0 1 | 2 | 3    4 spare

Causal within the new tokens: row i (0-based among its sequence's new ones) sees keys
0 .. seq_len - query_len + i. Keys stream through an online softmax a tile at a time; tiles past
a q-block's last visible key are never read. With segments > 1 (split-KV, for long decode
contexts) each program covers one slice of the tiles and writes an unnormalised partial that
`split_kv.reduce_segments` merges.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from chatstore.kernels.triton.kv_write import check_pool
from chatstore.kernels.triton.launch import emulate_bf16, next_pow2, to_dtype
from chatstore.kernels.triton.split_kv import SegmentPartials, choose_segments, reduce_segments


class AttentionMeta(NamedTuple):
    """A step's sequence layout on the device, built once and read by every layer."""

    block_tables: torch.Tensor  # [S, W] int32 or int64, padded with any valid block id
    query_start: torch.Tensor  # [S + 1] int32: first row of each sequence in q, then T
    seq_lens: torch.Tensor  # [S] int32: context length, new tokens included
    max_query_len: int  # host copies of what the launch shape depends on
    max_seq_len: int


def make_attention_meta(
    block_tables: torch.Tensor, query_lens: list[int], context_lens: list[int]
) -> AttentionMeta:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    device = block_tables.device
    return AttentionMeta(
        block_tables=block_tables,
        query_start=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(context_lens),
    )


@triton.jit
def _sequence_of(query_start_ptr, program, num_seqs, BLOCK_Q: tl.constexpr):
    """The largest i whose first q-block (query_start[i] // BLOCK_Q + i) is <= program."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_ptr + mid) // BLOCK_Q + mid <= program:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def unified_attention_kernel(
    out_ptr,  # [T, Hq, D]
    q_ptr,  # [T, Hq, D], rows may be strided (a view of the fused qkv)
    k_cache_ptr,  # [N, B, Hkv, D]
    v_cache_ptr,  # [N, B, Hkv, D]
    block_tables_ptr,  # [S, W]
    seq_lens_ptr,  # [S]
    query_start_ptr,  # [S + 1]
    part_out_ptr,  # [T, Hq, SEGMENTS, HEAD_P2] fp32 (split-KV only)
    part_max_ptr,  # [T, Hq, SEGMENTS] fp32
    part_sum_ptr,  # [T, Hq, SEGMENTS] fp32
    scale,
    num_seqs,
    num_heads,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_kn,
    stride_kb,
    stride_kh,
    stride_vn,
    stride_vb,
    stride_vh,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_P2: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SEGMENTS: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    program = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    seq = _sequence_of(query_start_ptr, program, num_seqs, BLOCK_Q)
    q_first = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - q_first
    q_block = program - (q_first // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    history = seq_len - query_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_P2)
    offs_t = tl.arange(0, TILE)
    query_pos = q_block * BLOCK_Q + offs_m // GROUP  # [BLOCK_M] among the sequence's new tokens
    head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M] query head of each row
    # BLOCK_M need not be a multiple of GROUP (3 query heads a KV head: 15 of 16 rows used).
    row_ok = (offs_m < BLOCK_Q * GROUP) & (query_pos < query_len)
    dim_ok = offs_d < HEAD_DIM
    token = (q_first + query_pos).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )  # [BLOCK_M, HEAD_P2]
    if EMULATE_BF16:
        q = q.to(tl.float32)

    # Keys any row of this q-block may see (causal), then this segment's share of the tiles.
    visible = tl.minimum(history + (q_block + 1) * BLOCK_Q, seq_len)
    tiles_per_segment = tl.cdiv(tl.cdiv(seq_len, TILE), SEGMENTS)
    tile_lo = segment * tiles_per_segment
    tile_hi = tl.minimum(tile_lo + tiles_per_segment, tl.cdiv(visible, TILE))

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running row max
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp(s - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_P2], dtype=tl.float32)
    for tile in range(tile_lo, tile_hi):
        key = tile * TILE + offs_t  # [TILE] key positions
        key_ok = key < visible
        block = tl.load(
            block_tables_ptr + seq * stride_bt + key // BLOCK_SIZE, mask=key_ok, other=0
        ).to(tl.int64)
        slot = key % BLOCK_SIZE
        k = tl.load(
            k_cache_ptr
            + block[None, :] * stride_kn
            + slot[None, :] * stride_kb
            + kv_head * stride_kh
            + offs_d[:, None],
            mask=dim_ok[:, None] & key_ok[None, :],
            other=0.0,
        )  # [HEAD_P2, TILE]
        v = tl.load(
            v_cache_ptr
            + block[:, None] * stride_vn
            + slot[:, None] * stride_vb
            + kv_head * stride_vh
            + offs_d[None, :],
            mask=key_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )  # [TILE, HEAD_P2]
        if EMULATE_BF16:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale  # [BLOCK_M, TILE] fp32
        causal = key[None, :] <= history + query_pos[:, None]
        s = tl.where(row_ok[:, None] & key_ok[None, :] & causal, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no key yet keeps m = -inf; subtract 0 instead (no inf - inf).
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # p in the cache's dtype for the PV product, as flash attention rounds it.
        p_v = to_dtype(p, v.dtype, EMULATE_BF16)
        if EMULATE_BF16:
            p_v = p_v.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p_v, v, input_precision=DOT_PRECISION)
        m_i = m_new

    if SEGMENTS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            to_dtype(out, out_ptr.dtype.element_ty, EMULATE_BF16),
            mask=row_ok[:, None] & dim_ok[None, :],
        )
    else:
        part = (token * num_heads + head) * SEGMENTS + segment  # [BLOCK_M]
        tl.store(part_out_ptr + part[:, None] * HEAD_P2 + offs_d[None, :], acc, row_ok[:, None])
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)


def unified_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMeta,
    scale: float,
    segments: int | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] (the step's new tokens, their K, V already in the pool) -> [T, Hq, D].

    `segments`: split-KV slices per q-block (a power of two; 1: no split); by default
    `choose_segments` picks from the step's shape."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check_pool(k_cache, v_cache)
    if q.stride(2) != 1:
        raise ValueError("unified_attention: each head of q must be contiguous")
    num_seqs = meta.seq_lens.shape[0]
    group = num_heads // num_kv_heads
    if segments is None:
        segments = choose_segments(meta.max_query_len, meta.max_seq_len, num_seqs * num_kv_heads)
    block_m = max(16, next_pow2(group))
    block_q = block_m // group
    head_p2 = max(16, next_pow2(head_dim))
    # Decode tiles are narrower: one query row a program leaves little work per key tile.
    tile = 16 if meta.max_query_len == 1 else 32
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    parts = SegmentPartials.empty(num_tokens, num_heads, segments, head_p2, q.device)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, segments)
    unified_attention_kernel[grid](
        out,
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start,
        parts.out,
        parts.max,
        parts.sum,
        scale,
        num_seqs,
        num_heads,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        meta.block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        GROUP=group,
        BLOCK_SIZE=block_size,
        TILE=tile,
        HEAD_DIM=head_dim,
        HEAD_P2=head_p2,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        SEGMENTS=segments,
        EMULATE_BF16=emulate_bf16(q.dtype),
        # fp32 products in full fp32, not TF32 (what the reference computes); moot for 16-bit.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 or emulate_bf16(q.dtype) else "tf32",
    )
    if segments > 1:
        reduce_segments(out, parts)
    return out
