"""A GGUF's projections packed straight from the file (`GGUFWeights.torch_pack` and
`native_pack`, issue 35) are what packing its repacked parts gave before, for both int4
kernels: the same pack bytes and scales for every role,
Llama's permuted q/k rows included, and the same products; types without repacking are left to
the other path."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from chatstore.engine.quant_linear import Int4Linear
from chatstore.kernels import native
from chatstore.model.gguf_source import GGUFWeightSource
from chatstore.model.gguf_weights import GGUFWeights
from chatstore.model.quant_weights import cat_int4_rows
from tests.support.gguf_writer import write_gguf
from tests.support.tiny_models import tiny_hf_model

pytestmark = pytest.mark.skipif(
    native.native_library() is None, reason="the native kernels do not build here"
)
ROLES = [("qkv", 1), ("o_proj", 1), ("gate_up", 0), ("down", 1), ("lm_head", None)]


def assert_packs_like_its_parts(gguf: GGUFWeights, role: str, layer: int | None) -> None:
    """Both kernels' layouts: torch's pack and scales_zeros, the native kernel's Int4Packed."""
    assert gguf.fuses(role, layer), role
    packed, native = gguf.torch_pack(role, layer), gguf.native_pack(role, layer)
    assert packed is not None and native is not None, role
    fused = cat_int4_rows([p.weight for p in gguf.parts(role, layer)])  # type: ignore[misc]
    x = torch.randn(3, fused.shape[1], generator=torch.Generator().manual_seed(0))
    direct, before = Int4Linear(packed, None), Int4Linear(fused, None, kernel="torch")
    assert direct.shape == before.shape and direct.repeat == before.repeat
    assert torch.equal(direct.packed, before.packed), role
    assert torch.equal(direct.scales_zeros, before.scales_zeros), role
    assert torch.equal(direct(x), before(x)), role
    direct, before = Int4Linear(native, None), Int4Linear(fused, None, kernel="native")
    assert direct.kernel == before.kernel == "native" and direct.shape == before.shape
    for name in ("packed", "scales", "mins"):
        assert torch.equal(getattr(direct.native, name), getattr(before.native, name)), role
    assert torch.equal(direct(x), before(x)), role


@pytest.mark.parametrize(("role", "layer"), ROLES)
def test_embedded_gguf_packs_like_its_repacked_parts(default_model, role, layer) -> None:
    """Q4_1 layers and the tied Q8_0 head (two int4 halves) of the model that ships."""
    assert_packs_like_its_parts(GGUFWeights(default_model.gguf, default_model.spec), role, layer)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0])
def test_llama_gguf_packs_its_permuted_rows_like_its_parts(tmp_path, qtype) -> None:
    """llama.cpp's q/k row order undone in the addresses, an untied head and token_embd."""
    path = write_gguf(tiny_hf_model("llama", seed=5), tmp_path / "tiny.gguf", qtype)
    gguf = GGUFWeights(path, GGUFWeightSource(path).spec)
    for role, layer in [*ROLES, ("embeddings", None)]:
        assert_packs_like_its_parts(gguf, role, layer)


def test_a_type_without_repacking_is_left_to_the_other_path(tmp_path) -> None:
    path = write_gguf(tiny_hf_model("llama", seed=5), tmp_path / "f32.gguf", Q.F32)
    gguf = GGUFWeights(path, GGUFWeightSource(path).spec)
    assert not gguf.fuses("qkv", 0)
    assert gguf.torch_pack("qkv", 0) is None and gguf.native_pack("qkv", 0) is None
