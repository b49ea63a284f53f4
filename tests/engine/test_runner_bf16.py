"""bf16, the default dtype where the CPU computes it natively: our runner against transformers
run in bf16 on the same weights (logits within a stated tolerance, the same greedy tokens). Ours
reads the GGUF directly in bf16; transformers' is its fp32 dequantisation cast to bf16."""

from __future__ import annotations

import pytest
import torch

from chatstore.engine.block_pool import BlockPool
from chatstore.engine.forward_batch import ForwardBatch, SequenceChunk
from chatstore.engine.generate import GenerateOptions, generate
from chatstore.engine.kv_cache import PagedKVCache, bytes_per_block
from chatstore.engine.runner import ModelRunner
from chatstore.engine.vattention import create_virtual_kv
from tests.engine.test_runner_exact import PROMPTS
from tests.support.reference import default_hf_model
from tests.support.tiny_models import chat_ids

# bf16 keeps 8 bits of mantissa: one rounding of a logit near 20 moves it by 0.06. Our fused ops
# round where torch's op-by-op arithmetic rounds, but GEMMs and attention sum in another order,
# and those differences compound over 30 layers, so the bar is relative to bf16 itself: our bf16
# logits may be no further from the fp32 answer than transformers' own bf16 run, with a margin.
BF16_ERROR_MARGIN = 1.5
# At a greedy step where the two bf16 runs pick different tokens, both must be near-ties under
# fp32: log-probabilities within this many nats (a bf16 logit near 20 rounds in steps of 0.125).
NEAR_TIE_NATS = 0.5
GREEDY_TOKENS = 32


@pytest.fixture(scope="module")
def bf16_model():
    from chatstore.model import load_model

    return load_model(dtype=torch.bfloat16)


def _runner(model, num_blocks: int = 64, layout: str = "paged"):
    if layout == "vattention":
        budget = num_blocks * bytes_per_block(model.spec, 16, torch.bfloat16)
        vkv, slots = create_virtual_kv(model.spec, 4, budget, 16, torch.bfloat16)
        return ModelRunner(model.weights, model.spec, vkv), slots
    kv = PagedKVCache(model.spec, num_blocks, 16, dtype=torch.bfloat16)
    return ModelRunner(model.weights, model.spec, kv), BlockPool(num_blocks)


def _logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


@pytest.mark.model
@pytest.mark.parametrize("layout", ["paged", "vattention"])
def test_bf16_logits_as_close_to_fp32_as_transformers_bf16(
    bf16_model, default_model, layout: str
) -> None:
    runner, pool = _runner(bf16_model, layout=layout)
    messages = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]
    ids = chat_ids(bf16_model.tokenizer, messages)
    batch = ForwardBatch.build([SequenceChunk(ids, 0, pool.allocate(4))], 16, all_logits=True)
    ours = runner.forward(batch)
    ref_bf16 = _logits(default_hf_model(torch.bfloat16), ids)
    ref_fp32 = _logits(default_hf_model(), ids)
    ours_err = (ours - ref_fp32).abs().max().item()
    hf_err = (ref_bf16 - ref_fp32).abs().max().item()
    print(
        f"bf16 logits: max |ours - transformers bf16| {(ours - ref_bf16).abs().max():.3f}; "
        f"from fp32: ours {ours_err:.3f}, transformers bf16 {hf_err:.3f}"
    )
    assert ours_err <= BF16_ERROR_MARGIN * hf_err
    agree = (ours.argmax(-1) == ref_fp32.argmax(-1)).float().mean().item()
    hf_agree = (ref_bf16.argmax(-1) == ref_fp32.argmax(-1)).float().mean().item()
    assert agree >= hf_agree - 0.05


@pytest.mark.model
@pytest.mark.parametrize(
    ("prompt", "layout"),
    [(p, "paged") for p in PROMPTS] + [(PROMPTS[0], "vattention")],
)
def test_bf16_greedy_tokens_match_transformers_bf16_generate(
    bf16_model, default_model, prompt: str, layout: str
) -> None:
    """32 greedy tokens equal transformers-bf16 `generate`'s, or the first token where they
    differ is a near-tie under fp32 logits (bf16 rounding decided it, not a wrong forward)."""
    tok, hf = bf16_model.tokenizer, default_hf_model(torch.bfloat16)
    ids = chat_ids(tok, [{"role": "user", "content": prompt}])
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=GREEDY_TOKENS,
            do_sample=False,
            pad_token_id=tok.eos_token_id,
        )[0, len(ids) :].tolist()
    runner, pool = _runner(bf16_model, num_blocks=16, layout=layout)
    options = GenerateOptions(max_new_tokens=GREEDY_TOKENS, stop_token_ids=(tok.eos_token_id,))
    ours = list(generate(runner, pool, ids, options))
    assert len(ref) == GREEDY_TOKENS
    if ours == ref:
        return
    i = next(j for j, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b)
    logprobs = torch.log_softmax(_logits(default_hf_model(), ids + ref[:i])[-1], -1)
    gap = abs(logprobs[ours[i]] - logprobs[ref[i]]).item()
    print(f"bf16 greedy: first divergence at token {i}; fp32 log-prob gap {gap:.3f} nats")
    assert gap <= NEAR_TIE_NATS
