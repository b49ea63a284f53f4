"""The engine end to end with the real SmolLM2-135M-Instruct: tokens, text, stop strings, cache."""

from __future__ import annotations

import asyncio

import pytest
import torch

from chatstore.config import Config
from chatstore.engine.async_engine import AsyncEngine
from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.request import Request, RequestOutput, SamplingParams
from chatstore.engine.runtime import create_runtime
from tests.support.reference import default_hf_model
from tests.support.tiny_models import chat_ids

pytestmark = pytest.mark.model

SYSTEM = "You are a concise assistant. Answer in one short sentence and never use lists."


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def run(engine_config: EngineConfig, model, requests: list[Request]) -> dict[str, list]:
    runtime = create_runtime(Config(kv_cache_bytes=64 << 20), model=model)

    async def main() -> dict[str, list[RequestOutput]]:
        engine = AsyncEngine(runtime, engine_config)
        engine.start()
        try:
            results = {}
            for r in requests:  # one after another, so later ones can hit the prefix cache
                results[r.request_id] = [o async for o in engine.submit(r)]
            return results
        finally:
            await engine.shutdown()
            assert runtime.pool.num_free == runtime.pool.num_blocks

    return asyncio.run(main())


def tokens(outs) -> list[int]:
    return [t for o in outs for s in o.samples for t in s.token_ids]


def text(outs) -> str:
    return "".join(s.text for o in outs for s in o.samples)


def test_greedy_tokens_and_text_match_transformers(default_model) -> None:
    tok = default_model.tokenizer
    ids = chat_ids(tok, [{"role": "user", "content": "What is the capital of France?"}])
    outs = run(EngineConfig(), default_model, [Request("q", ids, greedy(12))])["q"]
    with torch.inference_mode():
        ref = (
            default_hf_model()
            .generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids) :]
            .tolist()
        )
    eos = set(default_model.spec.eos_token_ids)
    assert tokens(outs) == ref[: len(tokens(outs))]
    assert text(outs) == tok.decode([t for t in tokens(outs) if t not in eos])
    assert outs[-1].usage.prompt_tokens == len(ids)


def test_stop_string_across_tokens_and_shared_system_prompt(default_model) -> None:
    tok = default_model.tokenizer
    system = {"role": "system", "content": SYSTEM}
    first = chat_ids(tok, [system, {"role": "user", "content": "Name a large ocean."}])
    second = chat_ids(tok, [system, {"role": "user", "content": "Name a tall mountain."}])
    free = run(EngineConfig(), default_model, [Request("a", first, greedy(16))])["a"]
    full = text(free)
    pieces = [tok.decode([t]) for t in tokens(free)]
    boundary = len(pieces[0]) + len(pieces[1])  # end of the second token's text
    stop = full[boundary - 2 : boundary + 2]  # two characters on each side of a token boundary
    outs = run(
        EngineConfig(),
        default_model,
        [Request("a", first, greedy(16, stop=(stop,))), Request("b", second, greedy(8))],
    )
    assert text(outs["a"]) == full[: full.find(stop)]
    assert outs["a"][-1].samples[-1].finish_reason == "stop"
    # The system prompt's full blocks were computed once, for "a", and reused by "b".
    assert outs["b"][-1].usage.cached_tokens >= 16
    uncached = run(
        EngineConfig(enable_prefix_cache=False), default_model, [Request("b", second, greedy(8))]
    )
    assert tokens(outs["b"]) == tokens(uncached["b"])


def test_three_turns_restored_from_device_tier_equal_recompute(default_model) -> None:
    """Store off, device prefix cache on: the history of turns 2 and 3 stays in the block pool
    between turns (the device tier) and gives the same greedy tokens as full recompute."""
    tok = default_model.tokenizer
    users = ["Name a large ocean.", "How deep is it?", "Name an animal that lives there."]

    def converse(engine_config: EngineConfig) -> list[tuple[list[int], int]]:
        runtime = create_runtime(Config(kv_cache_bytes=64 << 20), model=default_model)

        async def main() -> list[tuple[list[int], int]]:
            engine = AsyncEngine(runtime, engine_config)
            engine.start()
            messages = [{"role": "system", "content": SYSTEM}]
            turns = []
            try:
                for i, user in enumerate(users):
                    messages.append({"role": "user", "content": user})
                    request = Request(f"t{i}", chat_ids(tok, messages), greedy(12))
                    outs = [o async for o in engine.submit(request)]
                    turns.append((tokens(outs), outs[-1].usage.cached_tokens))
                    messages.append({"role": "assistant", "content": text(outs)})
            finally:
                await engine.shutdown()
            assert runtime.pool.num_free == runtime.pool.num_blocks
            return turns

        return asyncio.run(main())

    cached = converse(EngineConfig())
    recomputed = converse(EngineConfig(enable_prefix_cache=False))
    assert [t for t, _ in cached] == [t for t, _ in recomputed]
    assert all(c == 0 for _, c in recomputed)
    # Turn 1 reuses nothing; later turns find their history's full blocks in the pool.
    assert cached[0][1] == 0 and cached[1][1] >= 32 and cached[2][1] > cached[1][1]
