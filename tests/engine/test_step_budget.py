"""The step budget: `max_prefill_tokens_per_step` for a step no reply waits on (no decodes in
it), `max_tokens_per_step` for one that carries decodes."""

from __future__ import annotations

import pytest

from chatstore.config import load_config
from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.llm_engine import LLMEngine
from chatstore.engine.request import Request
from tests.support.engine import (
    assert_pool_clean,
    greedy,
    prompt,
    run_alone,
    tiny_runtime,
    tokens_of,
)

pytestmark = pytest.mark.usefixtures("single_thread")


def test_step_budget_is_the_larger_one_only_without_decodes() -> None:
    config = EngineConfig(max_tokens_per_step=16, max_prefill_tokens_per_step=64)
    assert config.step_budget(decoding=False) == 64
    assert config.step_budget(decoding=True) == 16
    # None (the engine's default) keeps one budget; a smaller prefill budget never shrinks it
    assert EngineConfig(max_tokens_per_step=16).step_budget(decoding=False) == 16
    small = EngineConfig(max_tokens_per_step=16, max_prefill_tokens_per_step=8)
    assert small.step_budget(decoding=False) == 16
    with pytest.raises(ValueError, match="max_prefill_tokens_per_step must be >= 1"):
        EngineConfig(max_prefill_tokens_per_step=0)


def test_the_server_config_carries_the_prefill_budget() -> None:
    assert load_config(env={}).max_prefill_tokens_per_step == 2048
    env = {"CHATSTORE_MAX_PREFILL_TOKENS_PER_STEP": "4096"}
    config = load_config(env=env)
    assert EngineConfig.from_config(config).max_prefill_tokens_per_step == 4096


def test_prompts_take_the_prefill_budget_until_a_reply_decodes() -> None:
    """A prompt alone prefills in chunks of the larger budget; once its reply decodes, the next
    prompt's chunks fit beside that decode in the smaller budget (a token every step), and every
    reply is the one its request gets alone."""
    small, large = 16, 64
    config = EngineConfig(max_tokens_per_step=small, max_prefill_tokens_per_step=large)
    engine = LLMEngine(tiny_runtime(num_blocks=256), config)
    first = Request("first", prompt(1, 150), greedy(40))
    second = Request("second", prompt(2, 120), greedy(3))
    outs: dict[str, list] = {}

    def step() -> set[str]:
        got = set()
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
            if any(s.token_ids for s in o.samples):
                got.add(o.request_id)
        return got

    engine.add_request(first)
    steps = 1
    while "first" not in step():
        steps += 1
    assert steps == -(-150 // large)  # 3 steps of <= 64 tokens, not 10 of 16
    engine.add_request(second)
    prefill_steps = 1
    while "second" not in (got := step()):
        assert "first" in got, "the running reply got no token while a prompt prefilled"
        prefill_steps += 1
    assert prefill_steps == -(-120 // (small - 1))  # beside one decode: 15 tokens a step
    while engine.has_work():
        step()
    for r in (first, second):
        assert tokens_of(outs[r.request_id]) == run_alone(r), r.request_id
    assert_pool_clean(engine)
