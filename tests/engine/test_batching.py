"""Continuous batching, chunked prefill, preemption and limits on tiny random models."""

from __future__ import annotations

import random

import pytest
import torch

from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.llm_engine import LLMEngine
from chatstore.engine.request import (
    EngineOverloadedError,
    InvalidRequestError,
    Request,
    RequestOutput,
)
from chatstore.engine.scheduler import WaitingEntry
from tests.support.engine import (
    assert_pool_clean,
    finish_of,
    greedy,
    prompt,
    run_all,
    run_alone,
    tiny_runtime,
    tokens_of,
)

pytestmark = pytest.mark.usefixtures("single_thread")


def make_requests(count: int, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request(f"r{i}", prompt(100 + i, rng.randint(3, 40)), greedy(rng.randint(1, 16)))
        for i in range(count)
    ]


def run_with_arrivals(
    engine: LLMEngine, requests: list[Request], seed: int = 1
) -> dict[str, list[RequestOutput]]:
    """Requests join at random steps while others are running."""
    rng = random.Random(seed)
    pending = list(requests)
    outs: dict[str, list[RequestOutput]] = {}
    while pending or engine.has_work():
        while pending and (not engine.has_work() or rng.random() < 0.4):
            engine.add_request(pending.pop(0))
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


LAYOUTS = ["paged", "vattention"]


@pytest.mark.parametrize(
    ("arch", "dtype", "layout"),
    [
        ("llama", torch.float32, "paged"),
        ("llama", torch.bfloat16, "paged"),
        ("qwen2", torch.float32, "paged"),
        ("qwen2", torch.bfloat16, "paged"),
        ("llama", torch.float32, "vattention"),
        ("qwen2", torch.bfloat16, "vattention"),
    ],
)
def test_continuous_batching_matches_each_request_alone(
    arch: str, dtype: torch.dtype, layout: str
) -> None:
    requests = make_requests(10)
    runtime = tiny_runtime(arch=arch, dtype=dtype, layout=layout)
    engine = LLMEngine(runtime, EngineConfig(max_tokens_per_step=24))
    outs = run_with_arrivals(engine, requests)
    for r in requests:
        alone = run_alone(r, arch, dtype, layout)
        assert tokens_of(outs[r.request_id]) == alone, r.request_id
        assert finish_of(outs[r.request_id]) == "length"
        assert outs[r.request_id][-1].usage.completion_tokens == r.sampling.max_tokens
    assert engine.stats().mean_batch_size > 1.5
    assert_pool_clean(engine)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_many_preemptions_still_complete_with_the_same_tokens(mode: str, dtype, layout) -> None:
    requests = [Request(f"p{i}", prompt(200 + i, 12 + 3 * i), greedy(24)) for i in range(6)]
    config = EngineConfig(preemption_mode=mode, max_tokens_per_step=64, swap_space_bytes=1 << 20)
    engine = LLMEngine(tiny_runtime(num_blocks=14, dtype=dtype, layout=layout), config)
    for r in requests:
        engine.add_request(r)
    outs = run_all(engine)
    stats = engine.stats()
    assert stats.preemptions >= 5
    if mode == "swap":
        assert stats.swapped_out_blocks > 0 and stats.swapped_in_blocks == stats.swapped_out_blocks
    for r in requests:
        alone = run_alone(r, dtype=dtype, layout=layout)
        assert tokens_of(outs[r.request_id]) == alone, r.request_id
    assert_pool_clean(engine)
    if engine.swap is not None:
        assert engine.swap.num_free == engine.swap.num_blocks


@pytest.mark.parametrize("layout", LAYOUTS)
def test_long_prompt_is_chunked_and_never_stalls_running_decodes(layout: str) -> None:
    runtime = tiny_runtime(num_blocks=128, layout=layout)
    engine = LLMEngine(runtime, EngineConfig(max_tokens_per_step=16))
    engine.add_request(Request("short", prompt(1, 5), greedy(30)))
    engine.step()
    engine.add_request(Request("long", prompt(2, 300), greedy(2)))
    decode_steps = 0
    long_started = False
    while engine.has_work():
        got = {o.request_id for o in engine.step() if any(s.token_ids for s in o.samples)}
        long_started = long_started or "long" in got
        if not long_started:
            assert "short" in got  # a decode every step while the long prompt is prefilled
            decode_steps += 1
    assert decode_steps >= 300 // 16 - 1
    assert_pool_clean(engine)


def test_long_prompts_arriving_together_are_prefilled_in_arrival_order() -> None:
    """vLLM's chunked-prefill FCFS: prompts that arrive together are prefilled one after the
    other, each taking what the step's budget leaves after the decodes, so the first prompt's
    first token does not wait for the backlog behind it, and the running decode gets its token
    every step meanwhile."""
    budget, length = 16, 80
    engine = LLMEngine(tiny_runtime(num_blocks=256), EngineConfig(max_tokens_per_step=budget))
    engine.add_request(Request("running", prompt(1, 5), greedy(60)))
    engine.step()
    names = [f"p{i}" for i in range(4)]
    for i, name in enumerate(names):
        engine.add_request(Request(name, prompt(10 + i, length), greedy(2)))
    first_token_step: dict[str, int] = {}
    step = 0
    while engine.has_work():
        step += 1
        got = {o.request_id for o in engine.step() if any(s.token_ids for s in o.samples)}
        for rid in got:
            first_token_step.setdefault(rid, step)
        if len(first_token_step) < len(names) + 1 and step < 60:
            assert "running" in got, f"step {step}: the running decode got no token"
    assert sorted(names, key=first_token_step.__getitem__) == names
    # The first prompt had the whole budget less the one decode token, every step.
    assert first_token_step["p0"] == -(-length // (budget - 1))
    assert_pool_clean(engine)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_static_batching_and_max_reservation_give_the_same_tokens(layout: str) -> None:
    requests = make_requests(6, seed=3)
    for config in (EngineConfig(batching="static"), EngineConfig(kv_reservation="max")):
        engine = LLMEngine(tiny_runtime(num_blocks=40, layout=layout), config)
        outs = run_with_arrivals(engine, requests)
        for r in requests:
            assert tokens_of(outs[r.request_id]) == run_alone(r, layout=layout)
        assert_pool_clean(engine)


def test_prefix_cache_hits_within_a_tenant_only() -> None:
    system = prompt(7, 16)
    engine = LLMEngine(tiny_runtime(), EngineConfig())
    engine.add_request(Request("a", [*system, 40, 41], greedy(3), tenant="t1"))
    run_all(engine)
    engine.add_request(Request("b", [*system, 50], greedy(3), tenant="t1"))
    engine.add_request(Request("c", [*system, 50], greedy(3), tenant="t2"))
    outs = run_all(engine)
    assert outs["b"][-1].usage.cached_tokens == 16
    assert outs["c"][-1].usage.cached_tokens == 0
    assert tokens_of(outs["b"]) == tokens_of(outs["c"])
    stats = engine.stats()
    assert stats.prefix_hits == 4 and stats.cached_blocks > 0
    assert stats.cached_tokens == stats.cached_blocks * 4
    assert_pool_clean(engine)


def test_waiting_queue_limit_and_look_ahead_snapshot() -> None:
    engine = LLMEngine(tiny_runtime(), EngineConfig(max_waiting=2))
    engine.add_request(Request("a", prompt(1, 5), greedy(), tenant="t", session_id="s1"))
    engine.add_request(Request("b", prompt(2, 7), greedy(), tenant="u", session_id="s2"))
    with pytest.raises(EngineOverloadedError, match="overloaded"):
        engine.add_request(Request("c", prompt(3, 5), greedy()))
    assert engine.waiting_sessions() == [
        WaitingEntry("a", "t", "s1", 5),
        WaitingEntry("b", "u", "s2", 7),
    ]
    run_all(engine)
    assert engine.waiting_sessions() == []
    assert_pool_clean(engine)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_requests_that_can_never_fit_get_a_clear_error(layout: str) -> None:
    engine = LLMEngine(tiny_runtime(num_blocks=8, layout=layout), EngineConfig())  # 32 tokens
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(Request("huge", prompt(1, 40), greedy()))
    assert err.value.field == "prompt" and "KV blocks" in str(err.value)
    with pytest.raises(InvalidRequestError, match="context"):
        engine.add_request(Request("ctx", prompt(1, 600), greedy()))
    # Fits at first, then outgrows the whole pool while alone: ends with "error", not a hang.
    engine.add_request(Request("grows", prompt(2, 20), greedy(40)))
    outs = run_all(engine)["grows"]
    assert finish_of(outs) == "error"
    assert "KV blocks" in (outs[-1].error or "")
    assert len(tokens_of(outs)) == 13  # 20 + 12 tokens fill 8 blocks; the 13th has no slot
    assert_pool_clean(engine)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_abort_frees_every_block(layout: str) -> None:
    engine = LLMEngine(tiny_runtime(layout=layout), EngineConfig())
    engine.add_request(Request("a", prompt(1, 9), greedy(50)))
    engine.add_request(Request("b", prompt(2, 9), greedy(50)))
    for _ in range(3):
        engine.step()
    engine.abort_request("a")
    engine.abort_request("b")
    engine.add_request(Request("c", prompt(3, 9), greedy(50)))
    engine.abort_request("c")  # still waiting
    outs = run_all(engine)
    assert {finish_of(outs[k]) for k in "abc"} == {"abort"}
    assert outs["a"][-1].usage.completion_tokens == 3  # one token per step
    assert_pool_clean(engine)
