"""The KV-write kernel: a step's k, v rows into the paged pool at their flat slots.

    k, v          [T, Hkv, D]      rows may be strided (views of the fused qkv)
    k/v cache     [N, B, Hkv, D]   slot s = block * B + offset is row s of the [N * B, Hkv, D] view
    slot_mapping  [T]              a negative slot is a padding row (a CUDA graph's spare rows):
                                   nothing is written for it

The pool holds K as attention reads it (rotated at its position); the store's copy is the
pre-RoPE K that the runner hands its KV sink before rotating (DESIGN: position-decoupled KV).
This kernel writes whatever K it is given: rotated K from a load (`rope_kv.rope_store_kv` is the
fused rotate-and-write of a forward).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from chatstore.kernels.triton.launch import emulate_bf16, next_pow2, to_dtype


@triton.jit
def store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_slot,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_P2: tl.constexpr,
    HEAD_P2: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, HEADS_P2)
    offs_d = tl.arange(0, HEAD_P2)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    cache = slot * stride_cache_slot + offs_h[:, None] * stride_cache_head + offs_d[None, :]
    k = tl.load(k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask)
    tl.store(
        k_cache_ptr + cache,
        to_dtype(k.to(tl.float32), k_cache_ptr.dtype.element_ty, EMULATE_BF16),
        mask,
    )
    v = tl.load(v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask)
    tl.store(
        v_cache_ptr + cache,
        to_dtype(v.to(tl.float32), v_cache_ptr.dtype.element_ty, EMULATE_BF16),
        mask,
    )


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v [T, Hkv, D] (last dim contiguous) into k_cache, v_cache [N, B, Hkv, D] (one layer,
    contiguous) at `slot_mapping` [T]: what `PagedKVCache.write` does for one layer."""
    num_tokens, num_kv_heads, head_dim = k.shape
    check_pool(k_cache, v_cache)
    store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_P2=next_pow2(num_kv_heads),
        HEAD_P2=next_pow2(head_dim),
        EMULATE_BF16=emulate_bf16(k_cache.dtype),
    )


def check_pool(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Slots index the [N * B] rows of a layer's K and V alike: both contiguous, same shape."""
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV pool's layer views must be contiguous")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"K and V pools differ: {tuple(k_cache.shape)} vs {tuple(v_cache.shape)}")
