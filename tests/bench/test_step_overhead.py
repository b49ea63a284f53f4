"""bench/step_overhead.py's phase timer: it times every phase and leaves the engine as it was."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from chatstore.engine import llm_engine
from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.forward_batch import ForwardBatch
from chatstore.engine.llm_engine import LLMEngine
from chatstore.engine.request import Request
from tests.support.engine import (
    greedy,
    prompt,
    tiny_runtime,
)

pytestmark = pytest.mark.usefixtures("single_thread")

BENCH = Path(__file__).resolve().parents[2] / "bench" / "step_overhead.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("step_overhead", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_phase_timer_times_each_phase_and_restores_the_engine() -> None:
    bench = load_bench()
    engine = LLMEngine(tiny_runtime(), EngineConfig())
    for i in range(3):
        engine.add_request(Request(f"r{i}", prompt(i, 5), greedy(4)))
    build, sample = ForwardBatch.__dict__["build"], llm_engine.sample_batch
    timer = bench.PhaseTimer(engine, engine.runtime.runner.device)
    decode_steps = []
    with timer.installed():
        while engine.has_work():
            ms, batch, all_decode = timer.step()
            assert set(ms) == {*bench.PHASES, "step"}
            if all_decode and batch == 3:
                decode_steps.append(ms)
    assert decode_steps
    for phase in ("schedule", "build", "forward", "sampling", "detok"):
        assert all(ms[phase] > 0 for ms in decode_steps), phase
    assert all(abs(sum(ms[p] for p in bench.PHASES) - ms["step"]) < 1e-6 for ms in decode_steps)
    assert ForwardBatch.__dict__["build"] is build and llm_engine.sample_batch is sample
    instance = ("_append", "_make_output")
    assert not set(instance) & set(vars(engine))
    assert "schedule" not in vars(engine.scheduler)
    assert "forward" not in vars(engine.runtime.runner)
