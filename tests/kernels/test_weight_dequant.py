"""Weights expanded just in time (`kernels/weight_dequant.py`, issue 35 item 2) against their
references, on every ISA variant this CPU runs and under each int4 pack layout torch uses
(its AVX512, AVX2 and generic kernels pack differently; each is probed in its own process)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from chatstore.engine.quant_linear import Int4Linear, Int8Linear
from chatstore.kernels import native
from chatstore.kernels.int4_matmul import pack_int4
from chatstore.kernels.weight_dequant import (
    DequantScratch,
    Int4PackLayout,
    int4_native_dequant,
    int4pack_dequant,
    int4pack_layout,
    int8_dequant,
    unpack_int4pack,
)
from chatstore.model.quant_weights import quantize_int4, quantize_int8
from tests.model.test_quant_weights import rounded

pytestmark = pytest.mark.skipif(
    native.native_library() is None, reason="the native kernels do not build here"
)
# rows: a multiple of 16 with a partial last block under both 64- and 32-row blocks
SHAPES = [(176, 64, 32), (80, 256, 64), (48, 96, 32)]


def _variants():
    return [(v.name, native.variant_library(v.name)) for v in native.runnable_variants()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k", "group"), SHAPES)
def test_int4pack_expands_to_the_weight_the_kernel_computes_with(n, k, group, dtype) -> None:
    """Exactly (q - 8) * scale + zero with the bf16 scales the kernel reads: a 4-bit code times
    a bf16 scale is exact in fp32, so only the final rounding to `dtype` happens."""
    torch.manual_seed(n + k)
    w = quantize_int4(torch.randn(n, k), group)
    lin = Int4Linear(w, None, kernel="torch")
    want = rounded(w).to(dtype).t()
    for name, lib in _variants():
        out = torch.full((k, n), float("nan"), dtype=dtype)
        int4pack_dequant(lin.packed, lin.scales_zeros, group, out, lib)
        assert torch.equal(out, want), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_pack_and_int8_expand_to_their_weights(dtype) -> None:
    torch.manual_seed(3)
    w = quantize_int4(torch.randn(96, 128), 32)
    packed = pack_int4(w.q, w.scale, w.zero, 1)
    # the native layout's w = q * scale + min: one fp32 rounding apart from the reference's
    want4 = (w.q.float() * packed.scales.repeat_interleave(32, 1)) + packed.mins.repeat_interleave(
        32, 1
    )
    q8 = quantize_int8(torch.randn(96, 128))
    scales8 = q8.scale.to(torch.bfloat16)
    want8 = (q8.q.float() * scales8.float()[:, None]).to(dtype)
    for name, lib in _variants():
        out4 = int4_native_dequant(packed, torch.empty(96, 128, dtype=dtype), lib)
        torch.testing.assert_close(out4, want4.to(dtype), rtol=2e-7, atol=1e-7, msg=name)
        assert torch.equal(
            int8_dequant(q8.q, scales8, torch.empty(96, 128, dtype=dtype), lib), want8
        )


def test_the_probe_reads_torchs_pack_and_rejects_a_wrong_layout() -> None:
    layout = int4pack_layout()
    assert layout is not None
    codes = torch.randint(0, 16, (176, 64), generator=torch.Generator().manual_seed(1))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2)
    assert torch.equal(unpack_int4pack(packed, 176, 64, layout), codes.to(torch.uint8))
    wrong = Int4PackLayout(layout.block_n, not layout.halves)
    assert not torch.equal(unpack_int4pack(packed, 176, 64, wrong), codes.to(torch.uint8))


_IN_CHILD = textwrap.dedent(
    """
    import torch
    from chatstore.engine.quant_linear import Int4Linear
    from chatstore.kernels.weight_dequant import int4pack_dequant, int4pack_layout
    from chatstore.model.quant_weights import quantize_int4
    from tests.model.test_quant_weights import rounded
    w = quantize_int4(torch.randn(176, 64), 32)
    lin = Int4Linear(w, None, kernel="torch")
    out = int4pack_dequant(lin.packed, lin.scales_zeros, 32, torch.empty(64, 176))
    assert torch.equal(out, rounded(w).t()), "expanded weight differs"
    x = torch.randn(3, 64)
    kernel = lin(x)
    expanded = (x.bfloat16() @ out.bfloat16()).float()
    assert (kernel - expanded).abs().max() <= 1e-2 * expanded.abs().max(), "kernel disagrees"
    print(tuple(int4pack_layout()))
    """
)


@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_torch_packs_of_other_cpu_kernels_are_found_and_expanded(capability) -> None:
    """What an AVX2-only CPU (or one torch has no vector kernels for) packs: torch picked by
    ATEN_CPU_CAPABILITY in a child process; its layout is probed, expanded exactly, and the
    expanded weight computes what torch's own kernel does with the same pack."""
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
    proc = subprocess.run(
        [sys.executable, "-c", _IN_CHILD], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    expected = {"avx2": "(32, True)", "default": "(32, False)"}[capability]
    assert proc.stdout.strip() == expected


def test_projections_share_one_scratch_grown_to_the_largest() -> None:
    scratch = DequantScratch(torch.float32)
    small = Int8Linear(quantize_int8(torch.randn(32, 64)), None, None, 8, scratch)
    big = Int4Linear(quantize_int4(torch.randn(96, 128), 32), None, None, 8, "torch", scratch)
    x_small, x_big = torch.randn(8, 64), torch.randn(8, 128)
    torch.testing.assert_close(small(x_small), x_small @ rounded(quantize_int8_of(small)).t())
    big(x_big)
    assert scratch.nbytes == 96 * 128 * 4
    before = scratch.view(1, 1).data_ptr()
    small(x_small)  # a smaller weight reuses the buffer
    assert scratch.view(1, 1).data_ptr() == before and scratch.nbytes == 96 * 128 * 4
    with pytest.raises(ValueError, match="fp32 or bf16"):
        DequantScratch(torch.float16)


def quantize_int8_of(lin: Int8Linear):
    from chatstore.model.quant_weights import Int8Weight

    return Int8Weight(lin.q, lin.scales.float())


def test_packing_a_slice_of_rows_at_a_time_gives_torchs_whole_pack(monkeypatch) -> None:
    from chatstore.engine import quant_linear

    codes = torch.randint(0, 16, (256 + 48, 64), generator=torch.Generator().manual_seed(2))
    whole = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2)
    monkeypatch.setattr(quant_linear, "PACK_ROWS", 128)  # three slices, the last a partial one
    assert torch.equal(quant_linear.pack_for_torch(codes.to(torch.uint8)), whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("repeat", [1, 2])
def test_rows_of_a_pack_are_the_weight_rows(dtype, repeat) -> None:
    """An embedding lookup from torch's int4 pack: the rows of the weight the kernel computes
    with (a repeated input's slices summed), ids across full and partial row blocks."""
    from chatstore.kernels.weight_dequant import int4pack_rows

    torch.manual_seed(repeat)
    w = quantize_int4(torch.randn(176, 64 * repeat), 32)._replace(input_repeat=repeat)
    lin = Int4Linear(w, None, kernel="torch")
    ids = torch.tensor([0, 5, 63, 64, 127, 130, 175, 5])
    want = rounded(w)[ids].to(dtype)
    for name, lib in _variants():
        got = int4pack_rows(lin.packed, lin.scales_zeros, 32, ids, repeat, dtype, lib)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=name)
    with pytest.raises(IndexError, match="outside the table's 176 rows"):
        int4pack_rows(lin.packed, lin.scales_zeros, 32, torch.tensor([176]), repeat, dtype)


@pytest.mark.parametrize("repeat", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_of_a_native_pack_are_its_expanded_rows(dtype, repeat) -> None:
    """The native kernel's table read by rows: the rows `int4_native_dequant` expands (fp32
    scales and mins, q * s + min), a repeated input's slices summed."""
    from chatstore.kernels.weight_dequant import int4_native_rows

    torch.manual_seed(10 + repeat)
    w = quantize_int4(torch.randn(96, 64 * repeat), 32)
    packed = pack_int4(w.q, w.scale, w.zero, repeat)
    full = int4_native_dequant(packed._replace(repeat=1), torch.empty(96, 64 * repeat))
    want = full.reshape(96, repeat, 64).sum(dim=1)  # fp32, the slices added as the kernel adds
    ids = torch.tensor([0, 7, 95, 40, 7])
    for name, lib in _variants():
        got = int4_native_rows(packed, ids, dtype, lib)
        torch.testing.assert_close(got, want[ids].to(dtype), rtol=1e-6, atol=1e-6, msg=name)
    with pytest.raises(IndexError, match="outside the table's 96 rows"):
        int4_native_rows(packed, torch.tensor([-1]), dtype)
