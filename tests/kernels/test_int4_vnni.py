"""The int8 prefill kernel (csrc/int4_vnni.c: int4 codes x int8 activations on AVX512-VNNI)
against its reference, from every resident int4 layout, on every ISA variant this CPU runs.

The reference is the same arithmetic in torch: activations quantized per block of 32 exactly as
the kernel does (tests/kernels/test_int4_matmul.py's `_quantized_x`), then a float64 matmul of
the dequantised weight, so only fp32 summation order (and a bf16 output's rounding) may differ.
Builds without AVX512 hold no such kernel and say so.
"""

from __future__ import annotations

import os

import pytest
import torch

from chatstore.engine.quant_linear import pack_for_torch
from chatstore.kernels import native
from chatstore.kernels.int4_matmul import pack_int4
from chatstore.kernels.int4_vnni import (
    int8_prefill_available,
    vnni_matmul_int4pack,
    vnni_matmul_native,
)
from chatstore.kernels.weight_dequant import Int4PackLayout, int4pack_layout, unpack_int4pack
from chatstore.model.quant_weights import Int4Weight, quantize_int4
from tests.kernels.test_int4_matmul import _quantized_x


def _vnni_cpu() -> bool:
    return "avx512_vnni" in native.cpu_flags()


def _weight(n: int, k: int, seed: int, symmetric: bool) -> Int4Weight:
    g = torch.Generator().manual_seed(seed)
    w = quantize_int4(torch.randn(n, k, generator=g), 32)
    if symmetric:  # GGUF's Q4_0: w = (q - 8) * scale, no zero
        w = w._replace(zero=torch.zeros_like(w.zero))
    # the kernels hold bf16 scales and zeros (torch's pack): the reference uses the same values
    return w._replace(scale=w.scale.bfloat16().float(), zero=w.zero.bfloat16().float())


def _product(x, w: Int4Weight, layout: str, symmetric: bool, lib) -> torch.Tensor:
    if layout == "native":
        return vnni_matmul_native(x, pack_int4(w.q, w.scale, w.zero, 1), symmetric, lib)
    found = int4pack_layout()
    assert found is not None
    sz = torch.stack([w.scale.t(), w.zero.t()], dim=-1).bfloat16().contiguous()
    return vnni_matmul_int4pack(x, pack_for_torch(w.q), sz, found, symmetric, lib)


def _built(lib) -> bool:
    return bool(lib.int4_vnni_built())


@pytest.mark.parametrize("layout", ["torch", "native"])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 40])  # partial and whole 6-token micro-tiles
def test_int8_prefill_is_the_integer_dot_product(layout, symmetric, dtype, tokens, variant_lib):
    w = _weight(192, 224, seed=tokens, symmetric=symmetric)  # 3 slabs of 64 rows, 7 blocks
    x = (3 * torch.randn(tokens, 224, generator=torch.Generator().manual_seed(1))).to(dtype)
    x[0, :32] = 0  # an all-zero block: step 0
    if not _built(variant_lib):
        with pytest.raises(RuntimeError, match="no VNNI kernel"):
            _product(x, w, layout, symmetric, variant_lib)
        return
    if not _vnni_cpu():
        pytest.skip("this CPU has no avx512_vnni")
    got = _product(x, w, layout, symmetric, variant_lib)
    assert got.dtype == dtype and got.shape == (tokens, 192)
    xq, _ = _quantized_x(x)
    want = xq @ w.dequantize().double().t()
    tol = 2**-8 if dtype == torch.bfloat16 else 1e-5  # the output's rounding / fp32 sums
    assert (got.double() - want).abs().max() <= tol * want.abs().max()


def test_both_layouts_and_torchs_slow_path_give_the_same_product(variant_lib) -> None:
    """torch's AVX512 pack (blocks of 64 in halves: the transposing fast path), the native layout
    and torch's other layouts (read code by code) are the same weight: equal results, bit for
    bit."""
    if not _built(variant_lib) or not _vnni_cpu():
        pytest.skip("no VNNI kernel in this build, or no avx512_vnni on this CPU")
    w = _weight(4096 + 64, 256, seed=3, symmetric=False)
    x = torch.randn(13, 256, generator=torch.Generator().manual_seed(2))
    fast = _product(x, w, "torch", False, variant_lib)
    assert torch.equal(fast, _product(x, w, "native", False, variant_lib))
    sz = torch.stack([w.scale.t(), w.zero.t()], dim=-1).bfloat16().contiguous()
    for layout in (Int4PackLayout(32, True), Int4PackLayout(64, False), Int4PackLayout(16, False)):
        packed = _pack(w.q, layout)
        assert torch.equal(unpack_int4pack(packed, w.q.shape[0], 256, layout), w.q.to(torch.uint8))
        got = vnni_matmul_int4pack(x, packed, sz, layout, False, variant_lib)
        assert torch.equal(got, fast), layout


def _pack(q: torch.Tensor, layout: Int4PackLayout) -> torch.Tensor:
    """Codes [N, K] in torch's pack under `layout` (the inverse of unpack_int4pack)."""
    n, k = q.shape
    out = torch.empty(n * k // 2, dtype=torch.uint8)
    q = q.to(torch.uint8)
    for n0 in range(0, n, layout.block_n):
        nb = min(layout.block_n, n - n0)
        rows = q[n0 : n0 + nb]
        if layout.halves and nb == layout.block_n:
            low, high = rows[: nb // 2], rows[nb // 2 :]
        else:
            low, high = rows[0::2], rows[1::2]
        out[n0 * k // 2 : (n0 + nb) * k // 2] = (low.t() | (high.t() << 4)).reshape(-1)
    return out.reshape(n, k // 2)


def test_untiled_shapes_and_wrong_widths_are_refused() -> None:
    lib = native.native_library()
    if lib is None or not _built(lib) or not _vnni_cpu():
        pytest.skip("no VNNI kernel here (no avx512_vnni, or no native kernels)")
    w = _weight(96, 64, 3, True)  # 96 rows: not whole slabs of 64
    with pytest.raises(ValueError, match="N % 64"):
        _product(torch.randn(2, 64), w, "native", True, lib)
    w = _weight(64, 64, 4, True)
    with pytest.raises(ValueError, match="width 64"):
        _product(torch.randn(2, 32), w, "native", True, lib)


def test_int8_prefill_is_offered_only_where_the_cpu_runs_it(monkeypatch) -> None:
    monkeypatch.setenv("CHATSTORE_INT8_PREFILL", "0")
    assert not int8_prefill_available()
    monkeypatch.setenv("CHATSTORE_INT8_PREFILL", "sometimes")
    with pytest.raises(ValueError, match="CHATSTORE_INT8_PREFILL"):
        int8_prefill_available()
    lib = native.native_library()
    runs = lib is not None and _vnni_cpu() and _built(lib)
    monkeypatch.setenv("CHATSTORE_INT8_PREFILL", "1")
    assert int8_prefill_available() == runs
    monkeypatch.delenv("CHATSTORE_INT8_PREFILL")  # auto: not where AMX computes bf16
    assert int8_prefill_available() == (runs and "amx_bf16" not in native.cpu_flags())
    hidden = os.environ.get("CHATSTORE_HIDE_CPU_FLAGS", "")
    monkeypatch.setenv("CHATSTORE_HIDE_CPU_FLAGS", f"{hidden},avx512_vnni")
    native.cpu_flags.cache_clear()  # read once a process: read again under the new setting
    try:
        assert not int8_prefill_available()  # what a CPU without VNNI is told
    finally:
        monkeypatch.undo()
        native.cpu_flags.cache_clear()
