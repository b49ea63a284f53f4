"""AsyncEngine: the model thread, streaming, abort, client cancellation, overload, shutdown."""

from __future__ import annotations

import asyncio
import gc

import pytest

from chatstore.engine.async_engine import AsyncEngine
from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.llm_engine import LLMEngine
from chatstore.engine.request import (
    EngineOverloadedError,
    InvalidRequestError,
    Request,
    RequestOutput,
    SamplingParams,
)
from tests.support.engine import (
    greedy,
    prompt,
    run_all,
    tiny_runtime,
    tokens_of,
)

pytestmark = pytest.mark.usefixtures("single_thread")


def make_engine(**kw) -> AsyncEngine:
    engine = AsyncEngine(tiny_runtime(num_blocks=kw.pop("num_blocks", 64)), EngineConfig(**kw))
    engine.start()
    return engine


async def collect(stream) -> list[RequestOutput]:
    return [out async for out in stream]


async def wait_idle(engine: AsyncEngine, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if not engine.engine.has_work():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("engine did not go idle")


async def assert_clean(engine: AsyncEngine) -> None:
    await wait_idle(engine)
    stats = engine.stats()
    assert stats.free_blocks == stats.num_blocks
    assert stats.running == stats.waiting == stats.swapped == 0
    engine.engine.runtime.pool.check_integrity()


def test_streams_match_the_synchronous_engine() -> None:
    requests = [Request(f"r{i}", prompt(i, 5 + 4 * i), greedy(6 + i)) for i in range(4)]
    sync = LLMEngine(tiny_runtime(), EngineConfig())
    for r in requests:
        sync.add_request(r)
    expected = {k: tokens_of(v) for k, v in run_all(sync).items()}

    async def main() -> None:
        engine = make_engine()
        streams = [
            engine.submit(Request(r.request_id, r.prompt_token_ids, r.sampling)) for r in requests
        ]
        results = await asyncio.gather(*(collect(s) for s in streams))
        for r, outs in zip(requests, results, strict=True):
            assert tokens_of(outs) == expected[r.request_id]
            assert outs[-1].finished and outs[-1].usage.completion_tokens == r.sampling.max_tokens
            assert outs[0].first_token_time is not None
            assert all(not o.finished for o in outs[:-1])
        await assert_clean(engine)
        await engine.shutdown()
        assert not engine.is_running

    asyncio.run(main())


def test_abort_mid_generation_frees_every_block() -> None:
    async def main() -> None:
        engine = make_engine()
        stream = engine.submit(Request("a", prompt(1, 9), greedy(400)))
        outs = [await anext(stream) for _ in range(3)]
        engine.abort("a")
        outs += [o async for o in stream]
        assert outs[-1].finished and outs[-1].samples[-1].finish_reason == "abort"
        assert 3 <= outs[-1].usage.completion_tokens < 400
        await assert_clean(engine)
        await engine.shutdown()

    asyncio.run(main())


def test_cancelled_consumer_task_aborts_its_request() -> None:
    async def main() -> None:
        engine = make_engine()
        first = asyncio.Event()

        async def consume() -> None:
            async for _ in engine.submit(Request("c", prompt(2, 9), greedy(400))):
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await assert_clean(engine)
        assert engine.stats().requests_finished == 1
        await engine.shutdown()

    asyncio.run(main())


def test_consumer_that_stops_iterating_aborts_its_request() -> None:
    async def main() -> None:
        engine = make_engine()
        stream = engine.submit(Request("d", prompt(3, 9), greedy(400)))
        async for _ in stream:
            break
        del stream
        gc.collect()
        await assert_clean(engine)
        await engine.shutdown()

    asyncio.run(main())


def test_submit_raises_invalid_and_overloaded_itself() -> None:
    async def main() -> None:
        engine = make_engine(max_running=1, max_waiting=2)
        with pytest.raises(InvalidRequestError) as err:
            engine.submit(Request("bad", prompt(1, 5), SamplingParams(top_p=2.0)))
        assert err.value.field == "top_p"
        streams = []
        with pytest.raises(EngineOverloadedError):
            for i in range(10):  # at most one runs, two wait, then the queue is full
                streams.append(engine.submit(Request(f"o{i}", prompt(i, 5), greedy(300))))
        assert 2 <= len(streams) <= 3  # the model thread may have started the first one
        waiting = [w.request_id for w in engine.waiting_sessions()]
        assert waiting and waiting == [s.request_id for s in streams][-len(waiting) :]
        for s in streams:
            await s.aclose()
        await assert_clean(engine)
        await engine.shutdown()

    asyncio.run(main())


def test_shutdown_aborts_what_does_not_drain_in_time() -> None:
    async def main() -> None:
        engine = make_engine()
        quick = engine.submit(Request("quick", prompt(1, 5), greedy(3)))
        slow = engine.submit(Request("slow", prompt(2, 5), greedy(100_000 // 256)))
        await engine.shutdown(drain_timeout=0.05)
        quick_outs, slow_outs = await collect(quick), await collect(slow)
        assert quick_outs[-1].finished
        assert slow_outs[-1].samples[-1].finish_reason in ("abort", "length")
        assert engine.stats().free_blocks == engine.stats().num_blocks
        with pytest.raises(RuntimeError, match="not running"):
            engine.submit(Request("late", prompt(3, 5), greedy(3)))

    asyncio.run(main())
