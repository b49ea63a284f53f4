"""The int8 prefill kernel (csrc/int4_vnni.c: int4 codes x int8 activations on AVX512-VNNI)
against its reference, from both resident int4 layouts, on every ISA variant this CPU runs.

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
from chatstore.kernels.int4_vnni import Int8Scratch, int8_prefill_available, vnni_matmul
from chatstore.kernels.weight_dequant import int4pack_layout
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


def _tiles(w: Int4Weight, layout: str, symmetric: bool, lib, scratch: Int8Scratch):
    if layout == "native":
        return scratch.from_native(pack_int4(w.q, w.scale, w.zero, 1), symmetric, lib)
    found = int4pack_layout()
    assert found is not None
    sz = torch.stack([w.scale.t(), w.zero.t()], dim=-1).bfloat16().contiguous()
    return scratch.from_int4pack(
        pack_for_torch(w.q), sz, found.block_n, found.halves, symmetric, lib
    )


def _built(lib) -> bool:
    return bool(lib.int4_vnni_built())


@pytest.mark.parametrize("layout", ["torch", "native"])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 40])  # partial and whole 6-token micro-tiles
def test_int8_prefill_is_the_integer_dot_product(layout, symmetric, dtype, tokens, variant_lib):
    if not _built(variant_lib):
        with pytest.raises(RuntimeError, match="no VNNI kernel"):
            w = _weight(64, 64, 0, symmetric)
            tiles = _tiles(w, layout, symmetric, variant_lib, Int8Scratch())
            vnni_matmul(torch.randn(2, 64), tiles, variant_lib)
        return
    if not _vnni_cpu():
        pytest.skip("this CPU has no avx512_vnni")
    w = _weight(160, 192, seed=tokens, symmetric=symmetric)  # 160 rows: 2.5 torch blocks of 64
    x = (3 * torch.randn(tokens, 192, generator=torch.Generator().manual_seed(1))).to(dtype)
    x[0, :32] = 0  # an all-zero block: step 0
    got = vnni_matmul(x, _tiles(w, layout, symmetric, variant_lib, Int8Scratch()), variant_lib)
    assert got.dtype == dtype and got.shape == (tokens, 160)
    xq, _ = _quantized_x(x)
    want = xq @ w.dequantize().double().t()
    tol = 2**-8 if dtype == torch.bfloat16 else 1e-5  # the output's rounding / fp32 sums
    assert (got.double() - want).abs().max() <= tol * want.abs().max()


def test_both_layouts_give_the_same_tiles(variant_lib) -> None:
    if not _built(variant_lib) or not _vnni_cpu():
        pytest.skip("no VNNI kernel in this build, or no avx512_vnni on this CPU")
    w = _weight(4096 + 64, 256, seed=3, symmetric=False)  # whole 64-row blocks: the fast path
    a = _tiles(w, "torch", False, variant_lib, Int8Scratch())
    b = _tiles(w, "native", False, variant_lib, Int8Scratch())
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
    torch.testing.assert_close(a.mins, b.mins, rtol=0, atol=1e-7)


def test_one_scratch_serves_every_weight_and_refuses_untiled_shapes() -> None:
    lib = native.native_library()
    if lib is None or not _built(lib) or not _vnni_cpu():
        pytest.skip("no VNNI kernel here (no avx512_vnni, or no native kernels)")
    scratch = Int8Scratch()
    big, small = _weight(128, 256, 1, True), _weight(64, 64, 2, True)
    _tiles(big, "native", True, None, scratch)
    grown = scratch.nbytes
    t = _tiles(small, "native", True, None, scratch)
    assert scratch.nbytes == grown == 128 * 256 * (1 + 8 / 32)  # a byte a code, 2 fp32 a block
    x = torch.randn(5, 64)
    xq, _ = _quantized_x(x)
    want = xq @ small.dequantize().double().t()
    assert (vnni_matmul(x, t).double() - want).abs().max() <= 1e-5 * want.abs().max()
    with pytest.raises(ValueError, match="N % 32"):
        scratch.from_native(pack_int4(*_weight(48, 64, 3, True)[:3], 1), True)
    with pytest.raises(ValueError, match="width 64"):
        vnni_matmul(torch.randn(2, 32), t)


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
