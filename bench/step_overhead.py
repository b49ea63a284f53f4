"""Engine step overhead: where a decode step's time goes outside the model's forward.

Runs the real LLMEngine (default model unless --model, float32, no KV store) with N concurrent
requests (default N = 1 and 32; greedy and sampled with temperature/top_p; ignore_eos), steps
until every prompt is prefilled and has its first token, then times every following step whose
batch is N single-token decodes, split into phases:

    schedule   Scheduler.schedule
    build      ForwardBatch.build (token ids, positions, slots, block tables, decode plan)
    forward    ModelRunner.forward
    sampling   sample_batch
    detok      LLMEngine._append (stop checks, incremental detokenization, stop strings)
               + LLMEngine._make_output (deltas and RequestOutputs)
    other      the rest of LLMEngine.step (aborts, row gather, prefix-cache bookkeeping, ...)

    overhead = step - forward

The phases are timed by wrapping those functions in this process only (nothing in the engine
changes, and nothing is timed when this script is not running). With CUDA every wrapper
synchronises, so each phase carries its own kernels. Every case runs once untimed first (warm-up:
native kernel build, allocator). Prints a table, then one JSON line.

    python bench/step_overhead.py [--batches 1,32] [--tokens 64] [--threads N] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from chatstore.api.common.chat_template import ChatTemplate
from chatstore.config import load_config
from chatstore.engine import llm_engine as llm_engine_module
from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.forward_batch import ForwardBatch
from chatstore.engine.llm_engine import LLMEngine
from chatstore.engine.request import Request, SamplingParams
from chatstore.engine.runtime import Runtime, create_runtime

PHASES = ("schedule", "build", "forward", "sampling", "detok", "other")
TOPICS = (
    "the moon",
    "a good name for a cat",
    "writing clear sentences",
    "why the sky is blue",
    "the history of paper",
    "how bees make honey",
    "learning to play chess",
    "the water cycle",
)


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    sampling: SamplingParams


class PhaseTimer:
    """Wraps the engine's phase functions; accumulates seconds per phase for the current step."""

    def __init__(self, engine: LLMEngine, device: torch.device) -> None:
        self.engine = engine
        self.sync = device.type == "cuda"
        self.current: dict[str, float] = defaultdict(float)
        self.batch = 0
        self.all_decode = False

    def _sync(self) -> None:
        if self.sync:
            torch.cuda.synchronize()

    def _timed(self, phase: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            self._sync()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._sync()
                self.current[phase] += time.perf_counter() - t0

        return wrapper

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        engine, scheduler, runner = self.engine, self.engine.scheduler, self.engine.runtime.runner
        original_build = ForwardBatch.__dict__["build"]
        original_sample = llm_engine_module.sample_batch
        schedule = self._timed("schedule", scheduler.schedule)

        def schedule_and_note():
            plan = schedule()
            self.batch = len(plan.scheduled)
            self.all_decode = all(s.num_tokens == 1 for s in plan.scheduled)
            return plan

        scheduler.schedule = schedule_and_note
        runner.forward = self._timed("forward", runner.forward)
        engine._append = self._timed("detok", engine._append)
        engine._make_output = self._timed("detok", engine._make_output)
        build = self._timed("build", original_build.__func__)
        ForwardBatch.build = classmethod(build)  # type: ignore[method-assign]
        llm_engine_module.sample_batch = self._timed("sampling", original_sample)
        try:
            yield
        finally:
            ForwardBatch.build = original_build  # type: ignore[method-assign]
            llm_engine_module.sample_batch = original_sample
            for obj, name in ((scheduler, "schedule"), (runner, "forward")):
                del obj.__dict__[name]
            for name in ("_append", "_make_output"):
                del engine.__dict__[name]

    def step(self) -> tuple[dict[str, float], int, bool]:
        """One engine step: (ms per phase, batch size, whether it was all decodes)."""
        self.current = defaultdict(float)
        self._sync()
        t0 = time.perf_counter()
        self.engine.step()
        self._sync()
        total = time.perf_counter() - t0
        ms = {p: self.current[p] * 1000 for p in PHASES if p != "other"}
        ms["other"] = total * 1000 - sum(ms.values())
        ms["step"] = total * 1000
        return ms, self.batch, self.all_decode


def prompts(runtime: Runtime, n: int) -> list[list[int]]:
    """n short chat prompts (~30 tokens), each its own conversation."""
    template = ChatTemplate(runtime.model.tokenizer, runtime.model.spec.eos_token_ids)
    system = {"role": "system", "content": "You are a helpful assistant. Be brief."}
    return [
        template.render(
            [system, {"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]}."}]
        )
        for i in range(n)
    ]


def run_case(runtime: Runtime, case: Case, tokens: int, tag: str) -> list[dict[str, float]]:
    """Per-step phase times of the case's steady decode steps (batch == case.batch)."""
    engine = LLMEngine(runtime, EngineConfig(enable_prefix_cache=False))
    sampling = dataclasses.replace(case.sampling, max_tokens=tokens)
    for i, ids in enumerate(prompts(runtime, case.batch)):
        engine.add_request(Request(f"{tag}-{case.name}-{i}", ids, sampling))
    timer = PhaseTimer(engine, runtime.runner.device)
    steps = []
    with timer.installed():
        while engine.has_work():
            ms, batch, all_decode = timer.step()
            # Only steady decode steps: every prompt prefilled, the whole batch decoding.
            if all_decode and batch == case.batch:
                steps.append(ms)
    return steps


def summarize(steps: list[dict[str, float]]) -> dict[str, float]:
    keys = ("step", *PHASES)
    row = {k: statistics.median(s[k] for s in steps) for k in keys}
    row["overhead"] = statistics.median(s["step"] - s["forward"] for s in steps)
    row["steps"] = len(steps)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", default="1,32", help="comma-separated batch sizes")
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's own)")
    parser.add_argument("--kv-cache-mib", type=int, default=256)
    parser.add_argument("--no-sampled", action="store_true", help="greedy cases only")
    parser.add_argument("--quick", action="store_true", help="24 tokens per request")
    args = parser.parse_args()
    if args.quick:
        args.tokens = 24
    if args.threads:
        torch.set_num_threads(args.threads)
    config = load_config(
        overrides={
            "model": args.model,
            "dtype": "float32",
            "device": args.device,
            "kv_cache_bytes": args.kv_cache_mib << 20,
            "kv_store": "off",
        },
        env={},
    )
    runtime = create_runtime(config)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, ignore_eos=True)
    cases = []
    for b in (int(x) for x in args.batches.split(",")):
        cases.append(Case(f"greedy_b{b}", b, greedy))
        if not args.no_sampled:
            cases.append(Case(f"sampled_b{b}", b, sampled))
    rows: dict[str, dict[str, float]] = {}
    for case in cases:
        run_case(runtime, case, min(args.tokens, 8), "warmup")
        rows[case.name] = summarize(run_case(runtime, case, args.tokens, "run"))
    header = ("case", "steps", "step", *PHASES, "overhead")
    print(f"{header[0]:<12}" + "".join(f"{h:>10}" for h in header[1:]))
    for name, row in rows.items():
        cells = [f"{int(row['steps']):>10}"] + [f"{row[h]:>10.3f}" for h in header[2:]]
        print(f"{name:<12}" + "".join(cells))
    print("(median ms per steady decode step; overhead = step - forward)")
    result: dict[str, float | int | str] = {
        "model": args.model,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "tokens": args.tokens,
    }
    for name, row in rows.items():
        kind, b = name.split("_")
        prefix = "" if kind == "greedy" else "sampled_"
        for key in ("step", "overhead", "forward", "sampling", "schedule", "build", "detok"):
            result[f"{prefix}{key}_ms_{b}"] = round(row[key], 3)
        result[f"{prefix}other_ms_{b}"] = round(row["other"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
