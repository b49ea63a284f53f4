"""Faults stay with the request that caused them: a forward, save or sampling error for one
sequence fails that request only, the batch's other requests (other tenants) finish with the
tokens they get alone. A dead model thread ends every stream with an error, refuses new work,
and turns /readyz to 503."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from chatstore.api.admin import routes as admin
from chatstore.engine import llm_engine
from chatstore.engine.async_engine import AsyncEngine
from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.kv_connector import NullConnector
from chatstore.engine.llm_engine import LLMEngine
from chatstore.engine.request import EngineDeadError, Request, RequestOutput
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

GOOD = [
    Request(f"good{i}", prompt(10 + i, 5 + 3 * i), greedy(10), tenant=f"t{i}") for i in range(3)
]


def bad_request(n: int = 1) -> Request:
    sampling = greedy(10, n=n) if n > 1 else greedy(10)
    return Request("bad", prompt(99, 7), sampling, tenant="evil")


def start(engine: LLMEngine, bad: Request) -> None:
    for r in (GOOD[0], bad, *GOOD[1:]):
        engine.add_request(Request(r.request_id, list(r.prompt_token_ids), r.sampling, r.tenant))


def bad_is_running(engine: LLMEngine, after_tokens: int) -> bool:
    """The culprit is stepped and has produced `after_tokens` tokens already."""
    group = engine._groups.get("bad")
    return group is not None and group.seqs[0].num_output_tokens >= after_tokens


def assert_only_the_culprit_failed(outs: dict[str, list[RequestOutput]], message: str) -> None:
    assert outs["bad"][-1].finished and message in (outs["bad"][-1].error or "")
    assert {s.finish_reason for s in outs["bad"][-1].samples} == {"error"}
    for r in GOOD:
        assert outs[r.request_id][-1].error is None
        assert finish_of(outs[r.request_id]) == "length"
        assert tokens_of(outs[r.request_id]) == run_alone(r)


@pytest.mark.parametrize("n", [1, 2])
def test_a_forward_that_fails_for_one_request_fails_only_that_request(monkeypatch, n) -> None:
    engine = LLMEngine(tiny_runtime(), EngineConfig())
    runner = engine.runtime.runner
    forward = runner.forward

    def faulty(batch, *args, **kwargs):
        bad = engine._groups.get("bad")
        tables = batch.block_table_lists
        if bad_is_running(engine, 2) and any(s.block_table in tables for s in bad.seqs):
            raise RuntimeError("kernel fault on bad")
        return forward(batch, *args, **kwargs)

    monkeypatch.setattr(runner, "forward", faulty)
    start(engine, bad_request(n))
    outs = run_all(engine)
    assert_only_the_culprit_failed(outs, "kernel fault on bad")
    for index in range(n):  # what it made before the fault was streamed
        assert len(tokens_of(outs["bad"], index)) == 2
    assert_pool_clean(engine)


def test_a_connector_that_fails_saving_one_request_fails_only_that_request() -> None:
    class FailsOnBad(NullConnector):
        saves_kv = True

        def save_layer(self, layer, k_pre_rope, v, batch) -> None:
            if "bad" in batch.request_ids and layer == 1:
                raise OSError("store rejected bad")

    engine = LLMEngine(tiny_runtime(), EngineConfig(), FailsOnBad())
    start(engine, bad_request())
    outs = run_all(engine)
    assert_only_the_culprit_failed(outs, "store rejected bad")
    assert tokens_of(outs["bad"]) == []
    assert_pool_clean(engine)


def test_sampling_that_fails_for_one_request_fails_only_that_request(monkeypatch) -> None:
    engine = LLMEngine(tiny_runtime(), EngineConfig())
    sample_batch = llm_engine.sample_batch

    def faulty(logits, states):
        bad = engine._groups.get("bad")
        if bad_is_running(engine, 3) and any(s is bad.seqs[0].sample for s in states):
            raise ValueError("bad logits")
        return sample_batch(logits, states)

    monkeypatch.setattr(llm_engine, "sample_batch", faulty)
    start(engine, bad_request())
    outs = run_all(engine)
    assert_only_the_culprit_failed(outs, "bad logits")
    assert len(tokens_of(outs["bad"])) == 3
    assert_pool_clean(engine)


def test_a_forward_that_always_fails_fails_everyone_in_bounded_retries(monkeypatch) -> None:
    engine = LLMEngine(tiny_runtime(), EngineConfig())
    calls: list[int] = []

    def broken(batch, *args, **kwargs):
        calls.append(batch.num_seqs)
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runtime.runner, "forward", broken)
    start(engine, bad_request())
    outs = run_all(engine)
    assert engine.steps == 0
    assert len(calls) == 2 * 4 - 1  # the batch, then halves down to each request alone
    assert sorted(n for n in calls if n == 1) == [1, 1, 1, 1]
    for request_id in ("bad", *(r.request_id for r in GOOD)):
        assert "device lost" in (outs[request_id][-1].error or "")
    assert_pool_clean(engine)


# -- the model thread dies --------------------------------------------------------------------


class Fatal(BaseException):
    """Not an Exception: nothing inside a step catches it."""


def readyz(engine) -> tuple[int, dict]:
    app = FastAPI()
    app.include_router(admin.router)
    app.state.service = SimpleNamespace(engine=engine, draining=False)
    with TestClient(app) as client:
        response = client.get("/readyz")
    return response.status_code, response.json()


async def first_output(stream) -> RequestOutput:
    return await asyncio.wait_for(anext(stream), 10)


async def rest(stream) -> list[RequestOutput]:
    return [out async for out in stream]


def kill_when(armed: threading.Event, engine: AsyncEngine, where: str, exc: BaseException):
    """Once armed, the model thread meets `exc` in `where`, outside a step's own error
    handling: step() itself, or the hand-over of a step's outputs."""
    owner = engine.engine if where == "step" else engine
    original = getattr(owner, where)

    def dying(*args, **kwargs):
        if armed.is_set():
            raise exc
        return original(*args, **kwargs)

    setattr(owner, where, dying)


@pytest.mark.parametrize(
    ("where", "exc"),
    [("step", Fatal("cosmic ray")), ("_deliver", RuntimeError("cosmic ray"))],
)
def test_a_dead_engine_thread_ends_every_stream_and_refuses_work(where, exc) -> None:
    async def main() -> None:
        engine = AsyncEngine(tiny_runtime(), EngineConfig())
        assert engine.alive and engine.failure is None
        engine.start()
        assert readyz(engine) == (200, {"status": "ready"})
        armed = threading.Event()
        kill_when(armed, engine, where, exc)
        streams = [  # long enough to be mid-generation when it dies
            engine.submit(Request("x", prompt(1, 5), greedy(480), tenant="a")),
            engine.submit(Request("y", prompt(2, 6), greedy(480, n=2), tenant="b")),
        ]
        firsts = [await first_output(s) for s in streams]
        assert not any(o.finished for o in firsts)
        armed.set()
        ends = await asyncio.wait_for(asyncio.gather(*(rest(s) for s in streams)), 10)
        for outs, n in zip(ends, (1, 2), strict=True):
            last = outs[-1]
            assert last.finished and "cosmic ray" in (last.error or "")
            assert {s.finish_reason for s in last.samples} == {"error"}
            assert sorted(s.index for s in last.samples) == list(range(n))
        assert not engine.alive and "cosmic ray" in (engine.failure or "")
        with pytest.raises(EngineDeadError, match="cosmic ray"):
            engine.submit(Request("z", prompt(3, 5), greedy(4)))
        status, body = readyz(engine)
        assert status == 503 and body["status"] == "engine_failed"
        assert "cosmic ray" in body["error"]
        await asyncio.wait_for(engine.shutdown(drain_timeout=0.1), 10)

    asyncio.run(main())


def test_readyz_counts_engines_without_health_as_alive() -> None:
    assert readyz(SimpleNamespace())[0] == 200
    assert readyz(SimpleNamespace(alive=True, failure=None))[0] == 200


def test_a_clean_shutdown_is_not_a_failure() -> None:
    async def main() -> None:
        engine = AsyncEngine(tiny_runtime(), EngineConfig())
        engine.start()
        outs = await rest(engine.submit(Request("x", prompt(1, 5), greedy(3))))
        assert outs[-1].error is None
        await engine.shutdown()
        assert not engine.is_running and engine.alive and engine.failure is None
        with pytest.raises(RuntimeError, match="not running") as err:
            engine.submit(Request("y", prompt(1, 5), greedy(3)))
        assert not isinstance(err.value, EngineDeadError)

    asyncio.run(main())
