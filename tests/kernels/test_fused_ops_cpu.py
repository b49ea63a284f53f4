"""The fused native layer ops and the prepacked linear against their torch references."""

from __future__ import annotations

import pytest
import torch

from chatstore.engine.linear import Linear, packing_available
from chatstore.kernels.fused_ops import NativeOps, TorchOps
from chatstore.kernels.native import native_library

needs_native = pytest.mark.skipif(native_library() is None, reason="no native kernels (no gcc?)")
DTYPES = [torch.float32, torch.bfloat16]


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype == torch.bfloat16:
        # Same roundings as torch's op-by-op bf16; a last-bit flip where rsqrt/exp differ by an ulp.
        torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=8e-3)
    else:
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_rms_norm_and_residual_add(dtype, rows, variant_lib):
    gen = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, 96, generator=gen).to(dtype)
    delta = torch.randn(rows, 96, generator=gen).to(dtype)
    w = torch.randn(96, generator=gen).to(dtype)
    native = NativeOps(variant_lib)
    _close(native.rms_norm(h, w, 1e-6), TorchOps.rms_norm(h, w, 1e-6))
    h_native, h_torch = h.clone(), h.clone()
    out = native.add_rms_norm(h_native, delta, w, 1e-6)
    ref = TorchOps.add_rms_norm(h_torch, delta, w, 1e-6)
    assert torch.equal(h_native, h_torch)  # the residual add rounds exactly like torch's
    _close(out, ref)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_silu_mul(dtype, rows, variant_lib):
    gate_up = (4 * torch.randn(rows, 2 * 80, generator=torch.Generator().manual_seed(3))).to(dtype)
    _close(NativeOps(variant_lib).silu_mul(gate_up), TorchOps.silu_mul(gate_up))


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hq", "hkv", "head_dim"), [(4, 2, 16), (9, 3, 64)])
def test_rope_store_kv(dtype, hq, hkv, head_dim, variant_lib):
    rows, block, num_blocks = 11, 4, 9
    gen = torch.Generator().manual_seed(hq)
    qkv = torch.randn(rows, (hq + 2 * hkv) * head_dim, generator=gen).to(dtype)
    angles = torch.rand(rows, head_dim // 2, generator=gen) * 50
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    slots = torch.randperm(num_blocks * block, generator=gen)[:rows]
    caches = [torch.zeros(num_blocks, block, hkv, head_dim, dtype=dtype) for _ in range(4)]
    k_pre = qkv[:, hq * head_dim : (hq + hkv) * head_dim].clone()
    q_ref, k_ref, v_ref = TorchOps.rope_store_kv(
        qkv.clone(), cos, sin, slots, caches[0], caches[1], hq, hkv
    )
    ops = NativeOps(variant_lib)
    q, k, v = ops.rope_store_kv(qkv, cos, sin, slots, caches[2], caches[3], hq, hkv)
    _close(q, q_ref)
    _close(k, k_ref)
    assert torch.equal(v, v_ref)
    _close(caches[2], caches[0])
    assert torch.equal(caches[3], caches[1])
    # The pre-RoPE K stays in qkv for the store; q was rotated in place.
    assert torch.equal(qkv[:, hq * head_dim : (hq + hkv) * head_dim], k_pre)
    assert q.data_ptr() == qkv.data_ptr()


@pytest.mark.skipif(not packing_available(torch.device("cpu"), torch.float32), reason="no oneDNN")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 8, 33, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(dtype, rows, bias):
    if not packing_available(torch.device("cpu"), dtype):
        pytest.skip(
            "oneDNN does not prepack bf16 on this CPU (it needs AVX512 BW/VL/DQ or AVX-NE-CONVERT)"
        )
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 80, generator=gen).to(dtype)
    b = torch.randn(48, generator=gen).to(dtype) if bias else None
    x = torch.randn(rows, 80, generator=gen).to(dtype)
    layer = Linear(w, b, pack=True)
    assert layer.packed is not None
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(layer(x).float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 33])
def test_linear_as_the_runner_builds_it_matches_f_linear(dtype, rows):
    """Packed where this CPU's oneDNN packs the dtype, torch.mm elsewhere: right on any CPU."""
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 80, generator=gen).to(dtype)
    x = torch.randn(rows, 80, generator=gen).to(dtype)
    layer = Linear(w, None, pack=packing_available(torch.device("cpu"), dtype))
    assert (layer.packed is not None) == packing_available(torch.device("cpu"), dtype)
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(layer(x).float(), x.float() @ w.float().t(), atol=tol, rtol=tol)


def test_bf16_is_not_packed_where_onednn_cannot(monkeypatch):
    monkeypatch.setattr("chatstore.engine.linear.bf16_prepack_supported", lambda: False)
    assert not packing_available(torch.device("cpu"), torch.bfloat16)
    fp32 = packing_available(torch.device("cpu"), torch.float32)
    assert fp32 == torch.backends.mkldnn.is_available()
