"""Our runner is the same model as transformers: same logits, same greedy tokens."""

from __future__ import annotations

import pytest
import torch

from chatstore.engine.block_pool import BlockPool
from chatstore.engine.forward_batch import ForwardBatch, SequenceChunk
from chatstore.engine.generate import GenerateOptions, generate
from chatstore.engine.kv_cache import PagedKVCache
from chatstore.engine.runner import ModelRunner
from chatstore.model.spec import ModelSpec
from tests.conftest import TINY_ARCHS, chat_ids, tiny_hf_model

TOL = 1e-4


def make_runner(hf_model, num_blocks: int = 64, block_size: int = 16, attention: str = "auto"):
    spec = ModelSpec.from_hf_config(hf_model.config)
    kv = PagedKVCache(spec, num_blocks, block_size, dtype=torch.float32)
    return ModelRunner(hf_model, spec, kv, attention), BlockPool(num_blocks)


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def full_logits(runner, pool, ids: list[int], blocks=None) -> torch.Tensor:
    bs = runner.kv_cache.block_size
    blocks = blocks or pool.allocate((len(ids) + bs - 1) // bs)
    batch = ForwardBatch.build([SequenceChunk(ids, 0, blocks)], bs, all_logits=True)
    return runner.forward(batch)


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("attention", ["auto", "reference"])
def test_tiny_logits_match_transformers(arch: str, attention: str) -> None:
    model = tiny_hf_model(arch)
    runner, pool = make_runner(model, attention=attention)
    ids = torch.randint(
        0, model.config.vocab_size, (45,), generator=torch.Generator().manual_seed(1)
    )
    ours = full_logits(runner, pool, ids.tolist())
    assert (ours - hf_logits(model, ids.tolist())).abs().max().item() <= TOL


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_two_part_prefill_equals_one_part(arch: str) -> None:
    """Next turn of a conversation: new tokens on top of KV already in the pool."""
    model = tiny_hf_model(arch, seed=3)
    runner, pool = make_runner(model, block_size=8)
    ids = torch.randint(0, 256, (61,), generator=torch.Generator().manual_seed(2)).tolist()
    whole = full_logits(runner, pool, ids)
    blocks = pool.allocate(8)
    for split in (1, 8, 13, 40, 60):
        first = ForwardBatch.build([SequenceChunk(ids[:split], 0, blocks)], 8, all_logits=True)
        second = ForwardBatch.build([SequenceChunk(ids[split:], split, blocks)], 8, all_logits=True)
        head = runner.forward(first)
        tail = runner.forward(second)
        assert (torch.cat([head, tail]) - whole).abs().max().item() <= TOL, split


@pytest.mark.parametrize("attention", ["auto", "reference"])
def test_batched_decode_equals_alone(attention: str) -> None:
    """8 sequences of different lengths decoded in one batch = each decoded alone."""
    model = tiny_hf_model("llama", seed=5)
    runner, pool = make_runner(model, num_blocks=256, block_size=4, attention=attention)
    gen = torch.Generator().manual_seed(7)
    prompts = [
        torch.randint(2, 256, (n,), generator=gen).tolist() for n in (1, 3, 4, 5, 17, 30, 9, 64)
    ]
    steps = 12

    def run(group: list[int]) -> dict[int, list[int]]:
        tables = {i: pool.allocate(20) for i in group}
        chunks = [SequenceChunk(prompts[i], 0, tables[i]) for i in group]
        out: dict[int, list[int]] = {i: [] for i in group}
        # Prefill all in one mixed batch, then decode together.
        logits = runner.forward(ForwardBatch.build(chunks, 4))
        for _ in range(steps):
            tokens = torch.argmax(logits, dim=-1).tolist()
            for i, token in zip(group, tokens, strict=True):
                out[i].append(token)
            chunks = [
                SequenceChunk([t], c.context_len, c.block_table)
                for t, c in zip(tokens, chunks, strict=True)
            ]
            logits = runner.forward(ForwardBatch.build(chunks, 4))
        for t in tables.values():
            pool.free(t)
        return out

    together = run(list(range(8)))
    for i in range(8):
        assert run([i])[i] == together[i], i
    assert pool.num_free == pool.num_blocks
    pool.check_integrity()


def test_shuffled_block_ids_do_not_matter() -> None:
    model = tiny_hf_model("qwen2", seed=11)
    runner, pool = make_runner(model, num_blocks=32, block_size=4)
    ids = list(range(3, 40))
    blocks = pool.allocate(32)
    scrambled = [blocks[i] for i in (31, 2, 17, 9, 0, 5, 22, 13, 28, 1)]
    ours = full_logits(runner, pool, ids, blocks=scrambled)
    assert (ours - hf_logits(model, ids)).abs().max().item() <= TOL


@pytest.mark.model
def test_default_model_logits_match_transformers(default_model) -> None:
    runner, pool = make_runner(default_model.hf_model, num_blocks=64)
    messages = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]
    ids = chat_ids(default_model.tokenizer, messages)
    ours = full_logits(runner, pool, ids)
    assert (ours - hf_logits(default_model.hf_model, ids)).abs().max().item() <= TOL


# Prompts with long answers, so all 64 tokens are compared (generate stops at EOS).
PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how photosynthesis works, step by step.",
    "Describe the rules of chess for a beginner.",
    "Write a Python function that checks whether a number is prime, and explain it.",
]


@pytest.mark.model
@pytest.mark.parametrize("prompt", PROMPTS)
def test_default_model_greedy_64_tokens_match_generate(default_model, prompt: str) -> None:
    tok, hf = default_model.tokenizer, default_model.hf_model
    ids = chat_ids(tok, [{"role": "user", "content": prompt}])
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=64,
            do_sample=False,
            pad_token_id=tok.eos_token_id,
        )[0, len(ids) :].tolist()
    runner, pool = make_runner(hf, num_blocks=16)
    options = GenerateOptions(max_new_tokens=64, stop_token_ids=(tok.eos_token_id,))
    ours = list(generate(runner, pool, ids, options))
    assert len(ref) == 64
    assert ours == ref
    assert pool.num_free == pool.num_blocks
