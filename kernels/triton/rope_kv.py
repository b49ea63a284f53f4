"""RoPE fused with the KV write: one program per token of the fused q/k/v projection.

    qkv   [T, (Hq + 2 Hkv) D]   q heads | k heads | v heads, one row per token
    cos, sin [T, D]             at each token's position (rotate-half convention)

    q  rotated in place inside qkv           k  rotated into the pool at its slot
    v  copied into the pool at its slot      k in qkv is left pre-RoPE (the store saves it)

The contract of `NativeOps.rope_store_kv` (chatstore.kernels.fused_ops), rounding included:
x * cos and rotate_half(x) * sin each rounded to the dtype, then their sum. With `want_kv`,
k_out [T, Hkv, D] also receives the rotated k. A negative slot (a padding row) writes nothing
to the pool.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from chatstore.kernels.triton.kv_write import check_pool
from chatstore.kernels.triton.launch import emulate_bf16, next_pow2, to_dtype


@triton.jit
def _rotate(
    x_ptr, cos, sin, heads, offs_h, offs_d, HEAD_DIM: tl.constexpr, EMULATE_BF16: tl.constexpr
):
    """[HEADS_P2, HEAD_P2] rows of x (head stride HEAD_DIM) rotated by cos, sin [HEAD_P2]."""
    mask = (offs_h[:, None] < heads) & (offs_d[None, :] < HEAD_DIM)
    x = tl.load(x_ptr + offs_h[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0)
    partner = (offs_d + HEAD_DIM // 2) % HEAD_DIM  # rotate_half: [-x2, x1]
    x_rot = tl.load(x_ptr + offs_h[:, None] * HEAD_DIM + partner[None, :], mask=mask, other=0.0)
    sign = tl.where(offs_d < HEAD_DIM // 2, -1.0, 1.0)
    a = to_dtype(x.to(tl.float32) * cos[None, :], x.dtype, EMULATE_BF16).to(tl.float32)
    b = x_rot.to(tl.float32) * sign[None, :] * sin[None, :]
    b = to_dtype(b, x.dtype, EMULATE_BF16).to(tl.float32)
    return to_dtype(a + b, x.dtype, EMULATE_BF16), mask


@triton.jit
def rope_store_kv_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_out_ptr,
    stride_qkv,
    stride_cos,
    stride_sin,
    stride_cache_slot,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    Q_HEADS_P2: tl.constexpr,
    KV_HEADS_P2: tl.constexpr,
    HEAD_P2: tl.constexpr,
    WANT_KV: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, HEAD_P2)
    d_ok = offs_d < HEAD_DIM
    cos = tl.load(cos_ptr + token * stride_cos + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_sin + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    row = qkv_ptr + token * stride_qkv
    offs_q = tl.arange(0, Q_HEADS_P2)
    # Both halves of every head are loaded before any is stored, so rotating in place is safe.
    q, q_mask = _rotate(row, cos, sin, NUM_HEADS, offs_q, offs_d, HEAD_DIM, EMULATE_BF16)
    tl.store(row + offs_q[:, None] * HEAD_DIM + offs_d[None, :], q, mask=q_mask)

    offs_kv = tl.arange(0, KV_HEADS_P2)
    k_row = row + NUM_HEADS * HEAD_DIM
    k, kv_mask = _rotate(k_row, cos, sin, NUM_KV_HEADS, offs_kv, offs_d, HEAD_DIM, EMULATE_BF16)
    within = offs_kv[:, None] * HEAD_DIM + offs_d[None, :]  # [KV_HEADS_P2, HEAD_P2]
    v = tl.load(k_row + NUM_KV_HEADS * HEAD_DIM + within, mask=kv_mask)
    if WANT_KV:
        tl.store(k_out_ptr + token * NUM_KV_HEADS * HEAD_DIM + within, k, mask=kv_mask)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        cache = slot * stride_cache_slot + within
        tl.store(k_cache_ptr + cache, k.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(v_cache_ptr + cache, v.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)


def rope_store_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    want_kv: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """q [T, Hq, D] (a view of qkv, rotated in place); with `want_kv` the rotated k [T, Hkv, D]
    and a view of v [T, Hkv, D], else None for both. k_cache, v_cache [N, B, Hkv, D]."""
    rows, width = qkv.shape
    head_dim = cos.shape[-1]
    if qkv.stride(1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("rope_store_kv: rows of qkv, cos and sin must be contiguous")
    if width != (num_heads + 2 * num_kv_heads) * head_dim or head_dim % 2:
        raise ValueError(f"qkv width {width} does not hold {num_heads}+2x{num_kv_heads} heads")
    check_pool(k_cache, v_cache)
    k_out = None
    if want_kv:
        k_out = torch.empty((rows, num_kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    rope_store_kv_kernel[(rows,)](
        qkv,
        cos,
        sin,
        slot_mapping,
        k_cache,
        v_cache,
        qkv if k_out is None else k_out,  # never written without want_kv
        qkv.stride(0),
        cos.stride(0),
        sin.stride(0),
        k_cache.stride(1),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        Q_HEADS_P2=next_pow2(num_heads),
        KV_HEADS_P2=next_pow2(num_kv_heads),
        HEAD_P2=next_pow2(head_dim),
        WANT_KV=want_kv,
        EMULATE_BF16=emulate_bf16(qkv.dtype),
    )
    q = qkv[:, : num_heads * head_dim].view(rows, num_heads, head_dim)
    if k_out is None:
        return q, None, None
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(rows, num_kv_heads, head_dim)
    return q, k_out, v
