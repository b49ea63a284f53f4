"""Finish first (`finish_first_tokens`): a step without decodes in which a prompt's prefill
completes takes no further prompt tokens once it holds that many, so prompts arriving together
at an idle engine are not all answered at the end of one long step; a step carrying decodes packs
its budget as before; every reply stays the one its request gets alone."""

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


def first_token_steps(config: EngineConfig, requests: list[Request]) -> tuple[dict, dict]:
    """All requests added at once; the step at which each got its first token, and the outputs."""
    engine = LLMEngine(tiny_runtime(num_blocks=256), config)
    for r in requests:
        engine.add_request(r)
    outs: dict[str, list] = {}
    first: dict[str, int] = {}
    step = 0
    while engine.has_work():
        step += 1
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
            if any(s.token_ids for s in o.samples):
                first.setdefault(o.request_id, step)
    assert_pool_clean(engine)
    return first, outs


def test_prompts_arriving_together_are_answered_a_step_apart() -> None:
    requests = [Request(f"r{i}", prompt(i, 40), greedy(4)) for i in range(3)]
    packed, _ = first_token_steps(EngineConfig(max_tokens_per_step=256), requests)
    assert packed == {"r0": 1, "r1": 1, "r2": 1}  # one 120-token step answers all three at once
    config = EngineConfig(max_tokens_per_step=256, finish_first_tokens=32)
    first, outs = first_token_steps(config, requests)
    # r0 alone first; step 2 carries r0's decode, and a step with decodes packs as before
    assert first == {"r0": 1, "r1": 2, "r2": 2}
    for r in requests:
        assert tokens_of(outs[r.request_id]) == run_alone(r), r.request_id


def test_short_prompts_still_share_a_step_up_to_the_threshold() -> None:
    """Prompts of 10 tokens: a step takes them until it holds 32 tokens (four of them), so small
    prompts are not spread over a step each."""
    requests = [Request(f"r{i}", prompt(i, 10), greedy(2)) for i in range(6)]
    config = EngineConfig(max_tokens_per_step=256, finish_first_tokens=32)
    first, outs = first_token_steps(config, requests)
    assert [first[f"r{i}"] for i in range(6)] == [1, 1, 1, 1, 2, 2]
    for r in requests:
        assert tokens_of(outs[r.request_id]) == run_alone(r), r.request_id


def test_a_long_prompt_chunks_as_before_and_the_next_waits_for_its_end() -> None:
    """A prompt longer than the budget still fills whole steps; the step that finishes it takes
    nothing of the next prompt (it holds more than the threshold), the next step starts it."""
    requests = [
        Request("long", prompt(7, 100), greedy(3)),
        Request("next", prompt(8, 30), greedy(3)),
    ]
    config = EngineConfig(max_tokens_per_step=64, finish_first_tokens=16)
    first, outs = first_token_steps(config, requests)
    assert first == {"long": 2, "next": 3}  # 64 + 36 (not 36 + 28 of next), then next's 30
    for r in requests:
        assert tokens_of(outs[r.request_id]) == run_alone(r), r.request_id


def test_the_server_config_turns_it_on_and_bad_values_are_refused() -> None:
    assert EngineConfig().finish_first_tokens == 0  # the engine alone packs, as before
    assert load_config(env={}).finish_first_tokens == 256
    config = load_config(env={"CHATSTORE_FINISH_FIRST_TOKENS": "0"})
    assert EngineConfig.from_config(config).finish_first_tokens == 0
    with pytest.raises(ValueError, match="finish_first_tokens must be >= 0"):
        EngineConfig(finish_first_tokens=-1)
