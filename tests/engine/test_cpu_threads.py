"""The server leaves OpenMP to the engine thread: other threads compute on one intra-op thread."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from chatstore.cpu_threads import in_temporary_thread, leave_cores_to_engine
from chatstore.engine.async_engine import AsyncEngine
from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.request import Request, SamplingParams
from tests.support.engine import tiny_runtime


def test_in_temporary_thread_returns_and_raises() -> None:
    main = threading.get_ident()
    assert in_temporary_thread(lambda x: (x, threading.get_ident() != main), 3) == (3, True)
    with pytest.raises(KeyError, match="boom"):
        in_temporary_thread(lambda: {}["boom"])


def test_engine_thread_takes_the_cores_and_other_threads_one() -> None:
    before = torch.get_num_threads()
    seen: dict[str, int] = {}

    def probe(name: str) -> None:
        seen[name] = torch.get_num_threads()

    async def run() -> None:
        engine = AsyncEngine(tiny_runtime(), EngineConfig())
        engine.compute_threads = 2
        engine.start()
        engine.engine.step = _wrap(engine.engine.step, lambda: probe("engine"))
        stream = engine.submit(Request("r", [1, 2, 3], SamplingParams(max_tokens=2)))
        async for _ in stream:
            pass
        await engine.shutdown()

    try:
        assert leave_cores_to_engine() == before
        side = threading.Thread(target=probe, args=("side",))
        side.start()
        side.join()
        asyncio.run(run())
    finally:
        torch.set_num_threads(before)
    assert seen == {"side": 1, "engine": 2}


def _wrap(fn, before):
    def wrapped(*args, **kwargs):
        before()
        return fn(*args, **kwargs)

    return wrapped
