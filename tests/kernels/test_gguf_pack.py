"""GGUF rows packed straight into torch's int4 layout (`kernels/gguf_pack.py`, issue 35): the
file's own codes, in the bytes torch's packing makes of them, on every ISA variant this CPU runs
and under every layout torch packs in (checked against the reference reader of the layout, not
against torch, so the AVX2 and generic layouts are proved on an AVX512 machine too)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from chatstore.engine.quant_linear import pack_for_torch
from chatstore.kernels import native
from chatstore.kernels.gguf_pack import ROW_TYPES, gguf_to_int4_native, gguf_to_int4pack
from chatstore.kernels.int4_matmul import pack_int4
from chatstore.kernels.weight_dequant import Int4PackLayout, int4pack_layout, unpack_int4pack
from chatstore.model.gguf_repack import codes, input_repeat, scales_zeros
from tests.model.test_quant_weights import random_q4_k

pytestmark = pytest.mark.skipif(
    native.native_library() is None, reason="the native kernels do not build here"
)
LAYOUTS = [
    Int4PackLayout(64, True),
    Int4PackLayout(32, True),
    Int4PackLayout(32, False),
    Int4PackLayout(16, False),
]


def gguf_tensor(type_name: str, n: int, k: int, seed: int) -> np.ndarray:
    """[N, row bytes] as a GGUF holds it (Q4_K from random blocks: gguf quantizes no K-quant)."""
    rng = np.random.default_rng(seed)
    if type_name == "Q4_K":
        return random_q4_k(n, k, rng)
    w = rng.standard_normal((n, k)).astype(np.float32)
    return quantize(w, GGMLQuantizationType[type_name])


def row_addresses(data: np.ndarray, order: np.ndarray | None = None) -> np.ndarray:
    index = np.arange(data.shape[0]) if order is None else order
    return data.ctypes.data + index.astype(np.int64) * data.shape[1]


@pytest.mark.parametrize("n", [176, 160])
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("type_name", list(ROW_TYPES))
def test_rows_pack_to_the_files_codes_under_every_layout(n, type_name, layout, variant_lib) -> None:
    """176 rows (partial last blocks under 64 and 32) and 160 (a partial block of 32, which the
    4-bit types pack 16 x 16 at a time), read in a shuffled order: the codes the
    reference reader finds in the pack, and the scales and zeros gguf_repack computes, in bf16
    bit for bit (Q4_K's zero is two products and a difference: no fused multiply-add)."""
    k = 256
    data = gguf_tensor(type_name, n, k, seed=len(type_name))
    order = np.random.default_rng(1).permutation(n)
    k_out = k * input_repeat(type_name)
    kinds = np.full(n, ROW_TYPES[type_name], dtype=np.int8)
    packed, sz = gguf_to_int4pack(row_addresses(data, order), kinds, k_out, layout, variant_lib)
    rows = torch.from_numpy(order)
    want = codes(type_name, data, n, k)[rows]
    assert torch.equal(unpack_int4pack(packed, n, k_out, layout), want)
    scale, zero = (t[rows] for t in scales_zeros(type_name, data, n, k))
    assert torch.equal(sz, torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16))


@pytest.mark.parametrize("type_name", list(ROW_TYPES))
def test_rows_pack_to_the_native_kernels_layout(type_name, variant_lib) -> None:
    """The bytes, fp32 scales and mins `pack_int4` makes of the reference codes and scales."""
    n, k = 48, 512
    data = gguf_tensor(type_name, n, k, seed=3)
    order = np.random.default_rng(2).permutation(n)
    repeat = input_repeat(type_name)
    kinds = np.full(n, ROW_TYPES[type_name], dtype=np.int8)
    got = gguf_to_int4_native(row_addresses(data, order), kinds, k * repeat, repeat, variant_lib)
    rows = torch.from_numpy(order)
    scale, zero = (t[rows] for t in scales_zeros(type_name, data, n, k))
    want = pack_int4(codes(type_name, data, n, k)[rows], scale, zero, repeat)
    assert got.repeat == want.repeat and got.shape == want.shape
    for name in ("packed", "scales", "mins"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_mixed_rows_match_torchs_own_pack_of_their_codes() -> None:
    """Three tensors of three 4-bit types fused, as q/k/v: the bytes torch packs here."""
    layout = int4pack_layout()
    assert layout is not None
    parts = [("Q4_0", 64), ("Q4_1", 48), ("Q4_K", 80)]
    tensors = [gguf_tensor(t, n, 512, seed=i) for i, (t, n) in enumerate(parts)]
    addr = np.concatenate([row_addresses(d) for d in tensors])
    kinds = np.concatenate([np.full(n, ROW_TYPES[t], dtype=np.int8) for t, n in parts])
    packed, _ = gguf_to_int4pack(addr, kinds, 512, layout)
    want = torch.cat([codes(t, d, n, 512) for (t, n), d in zip(parts, tensors, strict=True)])
    assert torch.equal(packed, pack_for_torch(want))


def test_bad_rows_are_refused() -> None:
    layout = Int4PackLayout(64, True)
    data = gguf_tensor("Q4_0", 16, 64, seed=0)
    with pytest.raises(ValueError, match="row type"):
        gguf_to_int4pack(row_addresses(data), np.full(16, 9, dtype=np.int8), 64, layout)
    with pytest.raises(ValueError, match="does not divide"):  # Q4_K blocks are 256 wide
        gguf_to_int4pack(row_addresses(data), np.full(16, 2, dtype=np.int8), 64, layout)
    with pytest.raises(ValueError, match="one address and one type"):
        gguf_to_int4pack(row_addresses(data), np.zeros(15, dtype=np.int8), 64, layout)


def test_f16_scales_read_exactly_at_their_edges(variant_lib) -> None:
    """d = zero, subnormals, the largest half and negatives: read as numpy reads a half."""
    data = gguf_tensor("Q4_1", 16, 64, seed=2)
    edges = np.array([0x0000, 0x0001, 0x03FF, 0x0400, 0x7BFF, 0x8001, 0xFBFF, 0x3C00], np.uint16)
    fields = np.resize(edges, (16, 2, 2))  # (d, m) of each row's two blocks
    blocks = data.reshape(16, 2, 20)
    blocks[..., 0:4] = fields.view(np.uint8).reshape(16, 2, 4)
    kinds = np.full(16, ROW_TYPES["Q4_1"], dtype=np.int8)
    _, sz = gguf_to_int4pack(row_addresses(data), kinds, 64, LAYOUTS[0], variant_lib)
    scale, zero = scales_zeros("Q4_1", data, 16, 64)
    assert torch.equal(sz, torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16))
