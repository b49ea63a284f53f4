"""Per-tenant fairness of the waiting queue: a tenant's share of `max_waiting`, and admission
round-robin by tenant (FCFS within a tenant, preempted sequences first)."""

from __future__ import annotations

import math

import pytest

from chatstore.config import Config
from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.llm_engine import LLMEngine
from chatstore.engine.request import EngineOverloadedError, Request
from chatstore.transfer.session_staging import sessions_to_stage
from tests.support.engine import (
    assert_pool_clean,
    greedy,
    prompt,
    run_alone,
    tiny_runtime,
    tokens_of,
)

pytestmark = pytest.mark.usefixtures("single_thread")


def req(request_id: str, tenant: str, seed: int, max_tokens: int = 4) -> Request:
    return Request(request_id, prompt(seed, 6), greedy(max_tokens), tenant=tenant)


def waiting_ids(engine: LLMEngine) -> list[str]:
    return [w.request_id for w in engine.waiting_sessions()]


def test_tenant_queue_share_is_an_engine_setting() -> None:
    assert EngineConfig.from_config(Config()).tenant_queue_share == 0.5
    assert EngineConfig.from_config(Config(tenant_queue_share=0.25)).tenant_queue_share == 0.25
    for share, max_waiting, limit in ((0.5, 4, 2), (0.5, 5, 3), (0.01, 10, 1), (1.0, 7, 7)):
        config = EngineConfig(max_waiting=max_waiting, tenant_queue_share=share)
        assert config.tenant_queue_limit == limit
    for bad in (0.0, -0.5, 1.5, math.nan):
        with pytest.raises(ValueError, match="tenant_queue_share"):
            EngineConfig(tenant_queue_share=bad)


def test_a_tenant_cannot_take_every_waiting_slot() -> None:
    engine = LLMEngine(tiny_runtime(), EngineConfig(max_waiting=4, tenant_queue_share=0.5))
    engine.add_request(req("a1", "a", 1))
    engine.add_request(req("a2", "a", 2))
    with pytest.raises(EngineOverloadedError, match=r"tenant 'a' .*tenant limit 2"):
        engine.add_request(req("a3", "a", 3))
    engine.add_request(req("b1", "b", 4))  # another tenant still gets in
    engine.add_request(req("b2", "b", 5))
    with pytest.raises(EngineOverloadedError, match=r"4 requests waiting \(max_waiting=4\)"):
        engine.add_request(req("c1", "c", 6))  # the global limit still holds
    assert waiting_ids(engine) == ["a1", "b1", "a2", "b2"]
    engine.step()  # admits them all: the slots come back
    engine.add_request(req("a3", "a", 3))
    while engine.has_work():
        engine.step()
    assert_pool_clean(engine)


def test_admission_is_round_robin_by_tenant() -> None:
    # One running at a time: the order they finish in is the order they were admitted.
    engine = LLMEngine(tiny_runtime(), EngineConfig(max_running=1))
    for i in range(4):
        engine.add_request(req(f"a{i}", "a", i))
    engine.add_request(req("b0", "b", 10))
    engine.add_request(req("b1", "b", 11))
    engine.add_request(req("c0", "c", 20))
    expected = ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]
    assert waiting_ids(engine) == expected  # the store's look-ahead sees the same order
    assert [w.request_id for w in sessions_to_stage(engine, 3)] == expected[:3]
    finished, outputs = [], {}
    while engine.has_work():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
            if out.finished:
                finished.append(out.request_id)
    assert finished == expected
    assert tokens_of(outputs["b0"]) == run_alone(req("b0", "b", 10))
    assert_pool_clean(engine)


def test_a_tenant_arriving_later_goes_before_the_busy_tenants_backlog() -> None:
    engine = LLMEngine(tiny_runtime(), EngineConfig(max_running=1))
    for i in range(3):
        engine.add_request(req(f"a{i}", "a", i, max_tokens=3))
    engine.step()  # a0 runs
    engine.add_request(req("b0", "b", 10, max_tokens=3))
    assert waiting_ids(engine) == ["a1", "b0", "a2"]


def test_preempted_sequences_come_back_before_any_tenant() -> None:
    # 12 blocks of 4 tokens: two long requests cannot both grow, one is preempted.
    engine = LLMEngine(tiny_runtime(num_blocks=12), EngineConfig(max_running=2))
    engine.add_request(Request("a0", prompt(1, 18), greedy(12), tenant="a"))
    engine.add_request(Request("b0", prompt(2, 18), greedy(12), tenant="b"))
    engine.add_request(Request("c0", prompt(3, 6), greedy(2), tenant="c"))
    preempted = None
    while engine.has_work() and preempted is None:
        engine.step()
        if engine.scheduler.num_preemptions:
            preempted = waiting_ids(engine)
    assert preempted is not None and preempted[0] == "b0" and "c0" in preempted[1:]
    while engine.has_work():
        engine.step()
    assert_pool_clean(engine)
