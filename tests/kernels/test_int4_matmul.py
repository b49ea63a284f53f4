"""The native int4 kernel (int8 activations, integer dot products) against its references, on
every ISA variant this CPU runs, and the choice between it and torch's int4 kernel.

Two references: the same arithmetic in torch (activations quantized per block of 32 exactly as
the kernel does, then a float64 matmul of the dequantised weight: only fp32 summation order may
differ), and the float product of the unquantized activations, which may differ by at most the
activations' rounding, half a step per element: |y - y_float| <= sum_k |w_k| * d_block(k) / 2.
"""

from __future__ import annotations

import pytest
import torch

from chatstore.engine import quant_linear
from chatstore.engine.linear import Linear
from chatstore.engine.quant_linear import NEVER, Int4Linear, int4_kernel, int4_supported
from chatstore.engine.weight_plan import DENSE_FROM, Projections
from chatstore.kernels import native
from chatstore.kernels.int4_matmul import int4_matmul, pack_int4
from chatstore.model.quant_weights import Int4Weight, quantize_int4
from tests.engine.test_runner_exact import full_logits
from tests.model.test_quant_weights import greedy, runner_with
from tests.support.tiny_models import TINY_ARCHS, tiny_hf_model

ALWAYS_QUANT = dict.fromkeys(DENSE_FROM, NEVER)


def _quantized_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] as the kernel quantizes it: (codes * step) as float64, and each element's step."""
    t, k = x.shape
    blocks = x.float().reshape(t, k // 32, 32)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inv)  # round half to even, as nearbyintf
    step = (amax / 127.0).expand_as(blocks)
    return (codes.double() * step.double()).reshape(t, k), step.reshape(t, k).double()


def _weight(n: int, k: int, seed: int, repeat: int = 1) -> Int4Weight:
    w = quantize_int4(torch.randn(n, k * repeat, generator=torch.Generator().manual_seed(seed)), 32)
    return w._replace(input_repeat=repeat)


def _exact(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    xq, _ = _quantized_x(x)
    return xq @ w.dequantize().double().t()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 17])
@pytest.mark.parametrize("repeat", [1, 2])  # 2: an 8-bit GGUF code on two 4-bit ones
def test_kernel_is_the_integer_dot_product_of_int8_activations(dtype, tokens, repeat, variant_lib):
    w = _weight(50, 96, seed=tokens + repeat, repeat=repeat)  # 50 rows: a partial row tile
    x = (3 * torch.randn(tokens, 96, generator=torch.Generator().manual_seed(1))).to(dtype)
    x[0, :32] = 0  # an all-zero block: step 0, nothing divides by it
    got = int4_matmul(x, pack_int4(w.q, w.scale, w.zero, repeat), variant_lib)
    assert got.dtype == dtype and got.shape == (tokens, 50)
    want = _exact(x, w)
    tol = 2**-8 if dtype == torch.bfloat16 else 1e-5  # the output's rounding / fp32 sums
    assert (got.double() - want).abs().max() <= tol * want.abs().max()


def test_kernel_differs_from_the_float_product_by_the_activations_rounding_only(variant_lib):
    w = _weight(64, 576, seed=3)
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(2))
    got = int4_matmul(x, pack_int4(w.q, w.scale, w.zero, 1), variant_lib).double()
    dense = w.dequantize().double()
    _, step = _quantized_x(x)
    bound = (step / 2) @ dense.abs().t()  # [T, N]: half a step of every product
    err = (got - x.double() @ dense.t()).abs()
    assert (err <= bound * 1.001 + 1e-4).all()
    assert err.max() > 0  # it did quantize the activations


def test_every_variant_gives_the_same_result():
    """Integer sums are exact and the per-block float arithmetic is the same on every ISA."""
    w = _weight(40, 128, seed=7)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(3))
    packed = pack_int4(w.q, w.scale, w.zero, 1)
    outs = [
        int4_matmul(x, packed, native.variant_library(v.name)) for v in native.runnable_variants()
    ]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-4, rtol=1e-5)


def test_int4_linear_on_the_native_kernel_adds_its_bias_and_hands_prefill_to_dense():
    w = _weight(48, 64, seed=4)
    bias = torch.randn(48)
    dense = torch.nn.Linear(64, 48)
    dense.weight.data, dense.bias.data = w.dequantize(), bias
    lin = Int4Linear(w, bias, Linear(dense.weight, bias, pack=False), dense_from=8, kernel="native")
    assert lin.kernel == "native"
    x = torch.randn(3, 64)
    want = int4_matmul(x, pack_int4(w.q, w.scale, w.zero, 1)) + bias
    torch.testing.assert_close(lin(x), want)
    prompt = torch.randn(9, 64)
    torch.testing.assert_close(lin(prompt), dense(prompt).detach(), atol=1e-5, rtol=1e-5)


def test_group_64_stays_on_the_torch_kernel():
    w = quantize_int4(torch.randn(32, 128), 64)
    assert Int4Linear(w, None, kernel="native").kernel == "torch"


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_runner_on_the_native_kernel_matches_its_reference_runner(arch):
    """A whole model on the native kernel against the same model whose int4 projections compute
    the reference arithmetic in float64 (the same weights, the same activation quantization):
    the same logits up to fp32 sums, the same greedy tokens."""
    hf = tiny_hf_model(arch)
    ours = runner_with(
        hf, Projections("int4", torch.float32, True, dense_from=ALWAYS_QUANT, int4="native")
    )

    def reference(role, layer, weight, bias):
        n, k = weight.shape
        if not int4_supported(n, k, 32):  # Projections keeps such a shape dense too
            return Linear(weight, bias, pack=False)
        w = quantize_int4(weight, 32)
        return lambda x: (_exact(x, w) + (0 if bias is None else bias.double())).to(x.dtype)

    ref = runner_with(hf, reference)
    ids = torch.randint(2, 256, (21,), generator=torch.Generator().manual_seed(4)).tolist()
    logits, expected = full_logits(*ours, ids), full_logits(*ref, ids)
    assert (logits - expected).abs().max().item() <= 1e-3 * expected.abs().max().item()
    assert greedy(*ours, ids, 12) == greedy(*ref, ids, 12)


def test_auto_takes_the_native_kernel_where_bf16_is_emulated(monkeypatch):
    monkeypatch.delenv("CHATSTORE_INT4_KERNEL", raising=False)
    monkeypatch.setattr(native, "cpu_has_avx512_bf16", lambda: True)
    assert int4_kernel() == "torch"
    monkeypatch.setattr(native, "cpu_has_avx512_bf16", lambda: False)
    expected = "native" if native.native_library() is not None else "torch"
    assert int4_kernel() == expected
    monkeypatch.setenv("CHATSTORE_INT4_KERNEL", "torch")
    assert int4_kernel() == "torch"
    monkeypatch.setenv("CHATSTORE_INT4_KERNEL", "fast")
    with pytest.raises(ValueError, match="int4 kernel must be one of"):
        int4_kernel()
    assert quant_linear.INT4_KERNELS == ("auto", "torch", "native")


NEAR_TIE_NATS = 0.5  # as tests/engine/test_runner_bf16.py: a choice rounding may decide


def test_embedded_model_on_the_native_kernel_stays_within_bf16_noise(default_model):
    """The GGUF's own codes (Q4_1 layers, Q8_0 head on two int4 halves) on the native kernel
    against the fp32 runner over the dequantised GGUF: logits within the noise that rounding a
    projection's input and output to bf16 makes (measured 0.96 on logits up to ~30 against 0.97
    for that noise; torch's kernel 0.73), and the same greedy tokens until a near-tie under fp32
    (measured: 5 equal, then two candidates 0.22 nats apart)."""
    from chatstore.model.gguf_weights import GGUFWeights
    from tests.model.test_quant_weights import DequantisedMatmul

    gguf = GGUFWeights(default_model.gguf, default_model.spec)
    quant = Projections("gguf", torch.float32, True, gguf, dense_from=ALWAYS_QUANT, int4="native")
    ours = runner_with(default_model.weights, quant)
    assert "int4 kernel: native x121" in quant.describe()
    dense = runner_with(default_model.weights, None)
    edges = runner_with(default_model.weights, lambda r, i, w, b: DequantisedMatmul(w, b))
    ids = default_model.tokenizer.encode("The capital of France is")
    expected = full_logits(*dense, ids)
    bf16_noise = (full_logits(*edges, ids) - expected).abs().max().item()
    assert (full_logits(*ours, ids) - expected).abs().max().item() <= 3 * bf16_noise
    got, want = greedy(*ours, ids, 10), greedy(*dense, ids, 10)
    if got != want:
        at = next(i for i in range(10) if got[i] != want[i])
        logprobs = full_logits(*dense, ids + want[:at])[-1].log_softmax(-1)
        gap = (logprobs[want[at]] - logprobs[got[at]]).item()
        assert gap <= NEAR_TIE_NATS, f"token {at}: {got[at]} over {want[at]}, {gap:.2f} nats"


def test_auto_weights_fall_back_to_dense_where_torch_lacks_the_quantized_kernels(
    monkeypatch, caplog, default_model
):
    from chatstore.engine import weight_plan

    monkeypatch.setattr(weight_plan, "kernels_available", lambda: False)
    with caplog.at_level("WARNING", logger="chatstore.engine.weight_plan"):
        plan = weight_plan.plan_projections("auto", "auto", default_model, "auto", "cpu", False)
    assert plan is None
    assert "serving dense weights" in caplog.text
