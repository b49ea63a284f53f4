"""Admission with a reserve (`admission_reserve_tokens`): beside running sequences a waiting
prompt starts only where the pool holds all of its prompt and theirs, plus that many tokens of
output each. Admitted on its next chunk alone, a prompt overcommits a small pool, and the
prompts' later chunks and the replies' tokens preempt the newest sequence, whose computed KV is
dropped and computed again (8 agents on a 12,288-token pool: 9-13 preemptions in 80 steps,
none with a reserve of 64)."""

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
    run_all,
    run_alone,
    tiny_runtime,
    tokens_of,
)

pytestmark = pytest.mark.usefixtures("single_thread")


def requests() -> list[Request]:
    # 4-token blocks, 40 blocks: each request needs 10-13 blocks to finish, so three at once
    # overcommit the pool when each is admitted on its first 16-token chunk.
    return [Request(f"r{i}", prompt(300 + i, 28 + 4 * i), greedy(16)) for i in range(4)]


def run(reserve: int) -> tuple[LLMEngine, dict[str, list[int]]]:
    config = EngineConfig(max_tokens_per_step=16, admission_reserve_tokens=reserve)
    engine = LLMEngine(tiny_runtime(num_blocks=40), config)
    for r in requests():
        engine.add_request(r)
    outs = run_all(engine)
    return engine, {rid: tokens_of(o) for rid, o in outs.items()}


def test_a_reserve_admits_only_what_can_finish_and_nothing_is_preempted() -> None:
    overcommitted, tokens_without = run(reserve=0)
    reserved, tokens_with = run(reserve=16)
    assert overcommitted.stats().preemptions > 0  # what the reserve is for
    assert reserved.stats().preemptions == 0
    for r in requests():  # the same tokens either way, and as each alone
        assert tokens_with[r.request_id] == tokens_without[r.request_id] == run_alone(r)
    assert reserved.stats().mean_batch_size > 1.0  # still batched: more than one fits at once
    assert_pool_clean(overcommitted)
    assert_pool_clean(reserved)


def test_a_prompt_larger_than_the_reserve_allows_still_runs_alone() -> None:
    """The reserve never makes a request wait forever: with nothing running, the head of the
    queue starts on its first chunk as before (a pool that cannot hold it at all fails it)."""
    config = EngineConfig(max_tokens_per_step=16, admission_reserve_tokens=1000)
    engine = LLMEngine(tiny_runtime(num_blocks=40), config)
    for r in requests():
        engine.add_request(r)
    outs = run_all(engine)
    assert engine.stats().preemptions == 0
    for r in requests():
        assert tokens_of(outs[r.request_id]) == run_alone(r)
    assert_pool_clean(engine)


def test_the_server_sets_a_reserve_and_bad_values_are_refused() -> None:
    assert EngineConfig().admission_reserve_tokens == 0  # the engine's own default: as before
    assert EngineConfig.from_config(load_config(env={})).admission_reserve_tokens == 64
    env = {"CHATSTORE_ADMISSION_RESERVE_TOKENS": "0"}
    assert EngineConfig.from_config(load_config(env=env)).admission_reserve_tokens == 0
    with pytest.raises(ValueError, match="admission_reserve_tokens must be >= 0"):
        EngineConfig(admission_reserve_tokens=-1)
