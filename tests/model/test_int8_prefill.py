"""Prefill on int8 dot products (AVX512-VNNI) in a whole runner: from DENSE_FROM tokens on, each
int4 projection multiplies activations quantized per block of 32 against its 4-bit codes
(kernels/int4_vnni.py). The reference is a runner of plain fp32 matmuls over the dequantised
weights whose projections quantize their input the same way first, so the two agree to fp32
summation order; both kernels' layouts (torch's int4 pack and the native one) are checked, and
greedy tokens must match. A single token still runs the int4 decode kernel."""

from __future__ import annotations

import pytest
import torch

from chatstore.engine.linear import Linear
from chatstore.engine.runtime import prefill_of
from chatstore.engine.weight_plan import (
    DENSE_FROM,
    DENSE_FROM_INT8,
    DENSE_FROM_NATIVE,
    Projections,
    weights_fingerprint,
)
from chatstore.kernels.int4_vnni import int8_prefill_available
from chatstore.model.quant_weights import quantize_int4
from tests.engine.test_runner_exact import full_logits
from tests.kernels.test_int4_matmul import _quantized_x
from tests.model.test_quant_weights import greedy, rounded, runner_with
from tests.support.tiny_models import tiny_hf_model


@pytest.fixture(autouse=True)
def _int8_prefill(monkeypatch) -> None:
    """On wherever the CPU runs it (auto leaves it off on AMX CPUs), else skipped."""
    monkeypatch.setenv("CHATSTORE_INT8_PREFILL", "1")
    if not int8_prefill_available():
        pytest.skip("int8 prefill needs avx512_vnni (and the native kernels)")


class QuantizedInputMatmul:
    """x quantized per block of 32 to int8 (as the kernel does), then a float64 matmul of the
    dequantised weight; fp32 out."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight_t, self.bias = weight.double().t(), bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xq, _ = _quantized_x(x)
        y = (xq @ self.weight_t).to(x.dtype)
        return y if self.bias is None else y + self.bias


@pytest.mark.parametrize("int4", ["torch", "native"])
def test_prompt_logits_are_those_of_int8_activations_on_the_dequantised_weights(int4) -> None:
    hf = tiny_hf_model("llama", seed=5, tie_word_embeddings=True)
    quant = Projections("int4", torch.float32, True, int4=int4, tied_head=True)
    assert quant.scratch is not None and quant.scratch.int8
    ours = runner_with(hf, quant)

    def reference(role, layer, weight, bias):
        if role == "lm_head":  # the tied head runs on the embedding table itself
            return Linear(weight, bias, pack=False)
        return QuantizedInputMatmul(rounded(quantize_int4(weight, 32)), bias)

    ref = runner_with(hf, reference)
    ids = torch.randint(2, 256, (40,), generator=torch.Generator().manual_seed(6)).tolist()
    got, want = full_logits(*ours, ids), full_logits(*ref, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # 40 tokens >= DENSE_FROM
    # not the bf16/fp32 expansion's result: the activations' rounding shows
    plain = Projections("int4", torch.float32, True, int4=int4, tied_head=True)
    plain.scratch.int8 = False  # type: ignore[union-attr]
    expanded = full_logits(*runner_with(hf, plain), ids)
    assert (got - expanded).abs().max() > 100 * (got - want).abs().max()
    assert greedy(*ours, ids, 12) == greedy(*ref, ids, 12)
    # nothing of the int8 path lands in the scratch: it reads the 4-bit weight as it is
    assert quant.scratch.nbytes == 0
    # and it takes over from fewer tokens than the bf16 expansion (its crossover with the int4
    # decode kernel is lower)
    expected = DENSE_FROM_NATIVE if int4 == "native" else DENSE_FROM_INT8
    assert ours[0].layers[0].gate_up.dense_from == expected["gate_up"] < DENSE_FROM["gate_up"]


def test_kv_of_int8_prefill_is_stored_under_its_own_fingerprint() -> None:
    """A prompt's KV computed on int8 dot products differs (slightly) from one computed on the
    bf16 expansion or on 16-bit copies: a store shared by servers of different CPUs or settings
    must never hand one to the other."""
    hf = tiny_hf_model("llama", seed=5)
    int8 = Projections("int4", torch.float32, True, int4="torch")
    plain = Projections("int4", torch.float32, True, int4="torch")
    plain.scratch.int8 = False  # type: ignore[union-attr]
    copies = Projections("int4", torch.float32, True, int4="torch", prefill="copy")
    runner_with(hf, int8), runner_with(hf, plain), runner_with(hf, copies)
    modes = [prefill_of(p) for p in (int8, plain, copies)]
    assert modes == ["int8", "expanded", ""]
    prints = {weights_fingerprint("m", "int4", mode) for mode in modes}
    assert len(prints) == 3 and "m" not in prints
