"""AsyncEngine hand-over costs: one thread hop per step, merged outputs for a lagging consumer."""

from __future__ import annotations

import asyncio
import time

import pytest

from chatstore.engine.async_engine import AsyncEngine, merge_outputs
from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.llm_engine import LLMEngine
from chatstore.engine.request import Request, RequestOutput, SampleDelta, Usage
from tests.support.engine import (
    greedy,
    prompt,
    run_all,
    tiny_runtime,
    tokens_of,
)

pytestmark = pytest.mark.usefixtures("single_thread")


def test_merge_joins_each_samples_tokens_and_text_and_keeps_the_end() -> None:
    first = RequestOutput("r", [SampleDelta(0, [1], "a"), SampleDelta(1, [2], "b")], False, None,
                          None, 5.0)  # fmt: skip
    usage = Usage(3, 0, 4)
    then = RequestOutput("r", [SampleDelta(1, [4], "d", "stop"), SampleDelta(0, [3], "c")], True,
                         usage, None, 5.0)  # fmt: skip
    merged = merge_outputs(first, then)
    assert merged.samples == [SampleDelta(0, [1, 3], "ac"), SampleDelta(1, [2, 4], "bd", "stop")]
    assert merged.finished and merged.usage == usage and merged.first_token_time == 5.0
    assert first.samples[0].token_ids == [1]  # the inputs are left alone


def test_a_step_wakes_each_consumer_loop_once() -> None:
    """Outputs of many requests in one step: one call_soon_threadsafe, not one per request."""

    async def main() -> None:
        engine = AsyncEngine(tiny_runtime(), EngineConfig())
        loop = asyncio.get_running_loop()
        calls = []
        real = loop.call_soon_threadsafe

        def counting(*args):
            calls.append(args)
            return real(*args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        engine.start()
        try:
            streams = [engine.submit(Request(f"r{i}", prompt(i, 6), greedy(5))) for i in range(4)]
            outs = await asyncio.gather(*(_collect(s) for s in streams))
        finally:
            loop.call_soon_threadsafe = real  # type: ignore[method-assign]
            await engine.shutdown()
        assert all(tokens_of(o) and o[-1].finished for o in outs)
        steps = engine.engine.steps
        assert len(calls) <= steps < sum(len(o) for o in outs)

    asyncio.run(main())


@pytest.mark.parametrize("n", [1, 3])
def test_a_lagging_consumer_gets_merged_outputs_with_the_same_content(n: int) -> None:
    sampling = greedy(12) if n == 1 else greedy(12, n=n)
    request = Request("r", prompt(1, 7), sampling)
    sync = LLMEngine(tiny_runtime(), EngineConfig())
    sync.add_request(Request("r", list(request.prompt_token_ids), sampling))
    expected = run_all(sync)["r"]

    async def main() -> list[RequestOutput]:
        engine = AsyncEngine(tiny_runtime(), EngineConfig())
        engine.start()
        try:
            stream = engine.submit(request)
            first = await stream.__anext__()
            time.sleep(0.5)  # blocks the loop: the engine finishes while nothing is consumed
            return [first] + [out async for out in stream]
        finally:
            await engine.shutdown()

    outs = asyncio.run(main())
    assert len(outs) < len(expected)
    assert outs[-1].finished and outs[-1].usage == expected[-1].usage
    assert sum(o.finished for o in outs) == 1
    for i in range(n):
        assert tokens_of(outs, i) == tokens_of(expected, i)
        finish = [s.finish_reason for o in outs for s in o.samples if s.index == i]
        assert [f for f in finish if f] == ["length"]


async def _collect(stream) -> list[RequestOutput]:
    return [out async for out in stream]
