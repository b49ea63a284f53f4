"""TritonOps (interpreted on CPU tensors) against TorchOps, the contract NativeOps also meets.

Tolerances: the kernels round where torch's op-by-op arithmetic rounds, so what is element-wise
and rounded to the dtype is bit-equal: RoPE and the pool writes in every dtype (a GPU may
contract fp32 RoPE into FMAs: within an ulp there), the residual add, bf16 silu. Where an fp32
value is computed another way than torch computes it, the result is within a few ulps:
- the norms' sum of squares is a reduction in another order than torch's mean, so 1/rms may
  differ by an fp32 ulp; x * inv and w * that round twice more: 4 ulps in fp32, and in 16-bit
  the final rounding may flip: one ulp (measured: none flipped in these cases);
- silu's exp is not torch's CPU exp: 4 fp32 ulps; in fp16 one ulp (3 of 7,680 values measured).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from chatstore.kernels.fused_ops import TorchOps
from chatstore.kernels.triton.fused_ops import TritonOps
from chatstore.kernels.triton.kv_write import store_kv

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
EPS = 1e-6


def within_ulps(ours: torch.Tensor, ref: torch.Tensor, ulps: int) -> None:
    """|ours - ref| <= `ulps` units in the last place of ref (eps relative to |ref|)."""
    eps = torch.finfo(ref.dtype).eps
    err = (ours.float() - ref.float()).abs()
    assert bool((err <= ulps * eps * ref.float().abs()).all()), err.max().item()


def norm_ulps(dtype: torch.dtype) -> int:
    """fp32: the norm's 1/rms may differ by an ulp, then x * inv and w * that round twice: 4.
    16-bit: the fp32 difference is far below the final rounding, which it can flip: 1."""
    return 4 if dtype == torch.float32 else 1


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype: torch.dtype) -> None:
    x, w = randn(5, 576, dtype=dtype, seed=0), randn(576, dtype=dtype, seed=1)
    within_ulps(TritonOps.rms_norm(x, w, EPS), TorchOps.rms_norm(x, w, EPS), norm_ulps(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(dtype: torch.dtype) -> None:
    """The residual update is exact; the norm of it within one ulp."""
    h, delta = randn(4, 96, dtype=dtype, seed=2), randn(4, 96, dtype=dtype, seed=3)
    w = randn(96, dtype=dtype, seed=4)
    h_ref = h.clone()
    out = TritonOps.add_rms_norm(h, delta, w, EPS)
    ref = TorchOps.add_rms_norm(h_ref, delta, w, EPS)
    assert torch.equal(h, h_ref)
    within_ulps(out, ref, norm_ulps(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype: torch.dtype) -> None:
    """1,536 wide (SmolLM2's MLP): two column blocks a row, the second one partial."""
    gate_up = randn(5, 2 * 1536, dtype=dtype, seed=5)
    ours, ref = TritonOps.silu_mul(gate_up), TorchOps.silu_mul(gate_up)
    if dtype == torch.bfloat16:
        assert torch.equal(ours, ref)
    else:  # exp differs from torch's CPU one in the last bit: fp32 by ulps, fp16 rarely by one
        within_ulps(ours, ref, 4 if dtype == torch.float32 else 1)


def rope_inputs(dtype: torch.dtype, tokens: int, head_dim: int, seed: int):
    positions = torch.arange(tokens) * 37 + 5  # scattered positions, as after a truncation
    inv_freq = 1.0 / (100000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("want_kv", [True, False])
def test_rope_store_kv(dtype: torch.dtype, want_kv: bool) -> None:
    """SmolLM2's heads (9 q, 3 KV, D 64): q rotated in place, k rotated into the pool (and out),
    v copied; the pre-RoPE k in qkv untouched for the store; other slots untouched."""
    hq, hkv, d, tokens = 9, 3, 64, 6
    qkv = randn(tokens, (hq + 2 * hkv) * d, dtype=dtype, seed=6)
    cos, sin = rope_inputs(dtype, tokens, d, seed=7)
    slots = torch.tensor([3, 17, 40, 41, 2, 63])
    pools = [randn(4, 16, hkv, d, dtype=dtype, seed=8 + i) for i in range(4)]
    k_ref_pool, v_ref_pool, k_pool, v_pool = pools
    pre_rope_k = qkv[:, hq * d : (hq + hkv) * d].clone()
    q_ref, k_ref, v_ref = TorchOps.rope_store_kv(
        qkv.clone(), cos, sin, slots, k_ref_pool, v_ref_pool, hq, hkv
    )
    ours = qkv.clone()
    k_start, v_start = k_pool.clone(), v_pool.clone()
    q, k, v = TritonOps.rope_store_kv(ours, cos, sin, slots, k_pool, v_pool, hq, hkv, want_kv)
    assert torch.equal(q, q_ref)
    assert q.data_ptr() == ours.data_ptr()  # in place, as NativeOps
    assert torch.equal(ours[:, hq * d : (hq + hkv) * d], pre_rope_k)
    flat = (-1, hkv, d)
    assert torch.equal(k_pool.view(flat)[slots], k_ref_pool.view(flat)[slots])
    assert torch.equal(v_pool.view(flat)[slots], v_ref_pool.view(flat)[slots])
    others = torch.ones(64, dtype=torch.bool)
    others[slots] = False
    assert torch.equal(k_pool.view(flat)[others], k_start.view(flat)[others])
    assert torch.equal(v_pool.view(flat)[others], v_start.view(flat)[others])
    if want_kv:
        assert k is not None and v is not None
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    else:
        assert k is None and v is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_matches_the_pool_write(dtype: torch.dtype) -> None:
    """store_kv = PagedKVCache.write for one layer; strided k, v views; a negative slot (a
    padding row) writes nothing."""
    hkv, d = 3, 64
    rows = randn(5, 2 * hkv * d, dtype=dtype, seed=12)
    k = rows[:, : hkv * d].view(5, hkv, d)
    v = rows[:, hkv * d :].view(5, hkv, d)
    slots = torch.tensor([31, 0, -1, 16, 5])
    k_pool = randn(2, 16, hkv, d, dtype=dtype, seed=13)
    v_pool = randn(2, 16, hkv, d, dtype=dtype, seed=14)
    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    keep = slots >= 0
    k_ref.view(-1, hkv, d).index_copy_(0, slots[keep], k[keep])
    v_ref.view(-1, hkv, d).index_copy_(0, slots[keep], v[keep])
    store_kv(k, v, k_pool, v_pool, slots)
    assert torch.equal(k_pool, k_ref) and torch.equal(v_pool, v_ref)


def test_store_kv_narrows_to_the_pool_dtype() -> None:
    """fp32 rows into a bf16 pool round to nearest even, as `k.to(bfloat16)` does."""
    k, v = (
        randn(3, 2, 16, dtype=torch.float32, seed=15),
        randn(3, 2, 16, dtype=torch.float32, seed=16),
    )
    k_pool = torch.zeros(1, 16, 2, 16, dtype=torch.bfloat16)
    v_pool = torch.zeros_like(k_pool)
    store_kv(k, v, k_pool, v_pool, torch.tensor([0, 7, 15]))
    assert torch.equal(k_pool[0, [0, 7, 15]], k.to(torch.bfloat16))
    assert torch.equal(v_pool[0, [0, 7, 15]], v.to(torch.bfloat16))
