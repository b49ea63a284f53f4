"""Serving benchmark: Poisson arrivals at increasing rates, normalized latency per system.

Workload: seeded ShareGPT-like lengths (log-normal prompt and output lengths, clipped), random
token ids, `ignore_eos` so every request produces exactly its output length. For each rate the
requests arrive by a Poisson process; normalized latency = mean over requests of end-to-end
seconds / output tokens (the vLLM paper's metric). Systems, all on the same model and KV budget:

    paged       this engine: continuous batching, paged KV, chunked prefill
    static      the same engine, static batching: a batch runs until its longest request ends
    contiguous  the same engine reserving each request's maximum length up front (Orca-Max)
    hf          transformers `generate`, one request at a time (FIFO). Its service time does not
                depend on the load, so each request's generate is timed once and the queue is
                replayed exactly: finish_i = max(arrival_i, finish_{i-1}) + service_i.

A system's sustained rate is where its latency curve crosses `--threshold` (interpolated in
log(rate) between the last rate under it and the first over it); rates above a system's first
failure are not run. A saturation run (every
request at t=0) gives the mean batch size under the same KV budget, paged vs contiguous.

    python bench/serving.py [--quick] [--threshold 0.5] [--threads 1] [--no-progress]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import progress
from chatstore.config import Config
from chatstore.engine.async_engine import AsyncEngine
from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.request import Request, SamplingParams
from chatstore.engine.runtime import Runtime, create_runtime


@dataclass(frozen=True)
class Plan:
    rates: tuple[float, ...]  # requests / s, increasing
    window_s: float  # arrivals per rate span about this long (at least min_requests)
    min_requests: int
    prompt_len: tuple[int, int, int]  # median, min, max
    output_len: tuple[int, int, int]
    kv_budget_requests: int  # KV pool = this many maximum-length requests
    saturation_requests: int


FULL = Plan((0.125, 0.25, 0.5, 1.0, 2.0, 4.0), 30.0, 6, (120, 20, 400), (50, 10, 150), 12, 48)
QUICK = Plan((2.0, 4.0, 8.0), 3.0, 4, (40, 20, 100), (16, 10, 30), 6, 12)


@dataclass(frozen=True)
class Item:
    prompt: list[int]
    output_len: int


def workload(plan: Plan, count: int, vocab: int, seed: int = 0) -> list[Item]:
    rng = random.Random(seed)

    def length(spec: tuple[int, int, int]) -> int:
        median, lo, hi = spec
        return min(hi, max(lo, round(rng.lognormvariate(math.log(median), 0.8))))

    items = []
    for _ in range(count):
        n = length(plan.prompt_len)
        items.append(Item([rng.randrange(100, vocab) for _ in range(n)], length(plan.output_len)))
    return items


def arrival_times(rate: float, count: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    t, times = 0.0, []
    for _ in range(count):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def num_requests(plan: Plan, rate: float) -> int:
    return max(plan.min_requests, round(rate * plan.window_s))


def request(i: int, item: Item) -> Request:
    params = SamplingParams(max_tokens=item.output_len, temperature=0.0, ignore_eos=True)
    return Request(f"req-{i}", list(item.prompt), params)


async def drive(engine: AsyncEngine, items: list[Item], times: list[float], timeout: float):
    """Submit at the arrival times; normalized latency per request (unfinished: lower bound)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    latency: list[float | None] = [None] * len(items)

    async def one(i: int) -> None:
        await asyncio.sleep(max(0.0, start + times[i] - loop.time()))
        t0, produced = loop.time(), 0
        async for out in engine.submit(request(i, items[i])):
            produced += sum(len(s.token_ids) for s in out.samples)
        latency[i] = (loop.time() - t0) / max(produced, 1)

    tasks = [asyncio.create_task(one(i)) for i in range(len(items))]
    _, pending = await asyncio.wait(tasks, timeout=timeout)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    now = loop.time()
    return [
        lat if lat is not None else (now - start - times[i]) / items[i].output_len
        for i, lat in enumerate(latency)
    ]


def run_engine(runtime: Runtime, config: EngineConfig, items, times, timeout: float):
    async def main():
        engine = AsyncEngine(runtime, config)
        engine.start()
        try:
            lat = await drive(engine, items, times, timeout)
        finally:
            await engine.shutdown(drain_timeout=0.0)
        return lat, engine.stats().mean_batch_size

    return asyncio.run(main())


class HFServer:
    """transformers generate, one request at a time; service times cached per item."""

    def __init__(self, runtime: Runtime) -> None:
        from chatstore.model.hf_export import transformers_model

        self.model = transformers_model(runtime.model)  # the GGUF as transformers reads it
        self.service: dict[int, float] = {}

    def service_time(self, i: int, item: Item) -> float:
        if i not in self.service:
            ids = torch.tensor([item.prompt])
            t0 = time.perf_counter()
            with torch.inference_mode():
                self.model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=item.output_len,
                    min_new_tokens=item.output_len,
                    do_sample=False,
                    pad_token_id=0,
                )
            self.service[i] = time.perf_counter() - t0
        return self.service[i]

    def latencies(self, items: list[Item], times: list[float]) -> list[float]:
        finish, out = 0.0, []
        for i, (item, arrival) in enumerate(zip(items, times, strict=True)):
            finish = max(arrival, finish) + self.service_time(i, item)
            out.append((finish - arrival) / item.output_len)
        return out


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def sweep(
    name: str, measure, plan: Plan, items: list[Item], threshold: float, rates: tuple[float, ...]
) -> dict:
    """Normalized latency per rate until the first rate over the threshold."""
    curve: dict[float, float] = {}
    for k, rate in progress.track(enumerate(rates), f"{name} rates", len(rates)):
        n = num_requests(plan, rate)
        times = arrival_times(rate, n, seed=k + 1)
        t0 = time.perf_counter()
        result = measure(items[:n], times)
        curve[rate] = mean(result)
        print(
            f"  {name:<11} rate {rate:6.3f}/s  n={n:<3} norm latency {curve[rate]:7.3f} s/token"
            f"  ({time.perf_counter() - t0:5.1f} s)",
            flush=True,
        )
        if curve[rate] > threshold:
            break
    return {"curve": curve, "sustained_rate": crossing(curve, threshold)}


def crossing(curve: dict[float, float], threshold: float) -> float:
    """The rate where the latency curve crosses the threshold, interpolated in log(rate) between
    the last rate under it and the first over it (the highest rate run when none is over)."""
    passed = [(r, lat) for r, lat in curve.items() if lat <= threshold]
    failed = [(r, lat) for r, lat in curve.items() if lat > threshold]
    if not passed:
        return 0.0
    (r0, l0) = max(passed)
    if not failed:
        return r0
    (r1, l1) = min(failed)
    frac = (threshold - l0) / (l1 - l0)
    return round(math.exp(math.log(r0) + frac * (math.log(r1) - math.log(r0))), 3)


def ratio(a: float, b: float, lowest: float) -> float:
    """a / b; a baseline that sustains none of its rates counts as half its lowest (so the
    ratio is then a lower bound)."""
    return round(a / (b if b > 0 else lowest / 2), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small workload, about a minute")
    parser.add_argument("--threshold", type=float, default=0.3, help="s/token for 'sustained'")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    progress.add_argument(parser)
    args = parser.parse_args()
    progress.configure(args)
    plan = QUICK if args.quick else FULL
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    max_len = plan.prompt_len[2] + plan.output_len[2]
    block = 16
    budget_blocks = plan.kv_budget_requests * -(-max_len // block)
    probe = create_runtime(Config(kv_cache_bytes=1 << 20, block_size=block))
    per_block = probe.kv_cache.nbytes // probe.kv_cache.num_blocks
    runtime = create_runtime(
        Config(kv_cache_bytes=budget_blocks * per_block, block_size=block), model=probe.model
    )
    del probe
    vocab = runtime.model.spec.vocab_size
    count = max(num_requests(plan, plan.rates[-1]), plan.saturation_requests)
    items = workload(plan, count, vocab)
    print(
        f"model {runtime.model.spec.architecture}, threads {args.threads}, KV pool "
        f"{runtime.pool.num_blocks} blocks x {block} tokens ({plan.kv_budget_requests} requests "
        f"of max length {max_len}); threshold {args.threshold} s/token",
        flush=True,
    )
    configs = {
        "paged": EngineConfig(max_running=64),
        "static": EngineConfig(max_running=64, batching="static"),
        "contiguous": EngineConfig(max_running=64, kv_reservation="max", max_model_len=max_len),
    }
    warm = [Item(items[0].prompt, 4), Item(items[1].prompt[:20], 4)]
    run_engine(runtime, configs["paged"], warm, [0.0, 0.0], 120)  # first-forward costs
    results = {}
    for name, config in configs.items():
        timeout = 3 * plan.window_s + 30

        def measure(its, times, config=config, timeout=timeout):
            return run_engine(runtime, config, its, times, timeout)[0]

        results[name] = sweep(name, measure, plan, items, args.threshold, plan.rates)
    hf = HFServer(runtime)
    # One request at a time is slow: its ladder starts lower (its replay costs no wall time).
    hf_rates = (plan.rates[0] / 4, plan.rates[0] / 2, *plan.rates)
    results["hf"] = sweep("hf", hf.latencies, plan, items, args.threshold, hf_rates)
    sat = items[: plan.saturation_requests]
    zero = [0.0] * len(sat)
    batch = {
        name: run_engine(runtime, configs[name], sat, zero, 600)[1]
        for name in ("paged", "contiguous")
    }
    print_summary(results, batch, args.threshold)
    ours, low = results["paged"]["sustained_rate"], plan.rates[0]
    summary = {
        "bench": "serving",
        "quick": args.quick,
        "threshold_s_per_token": args.threshold,
        "sustained_rate": {k: v["sustained_rate"] for k, v in results.items()},
        "rate_ratio_vs_static": ratio(ours, results["static"]["sustained_rate"], low),
        "rate_ratio_vs_contiguous": ratio(ours, results["contiguous"]["sustained_rate"], low),
        "rate_ratio_vs_hf": ratio(ours, results["hf"]["sustained_rate"], hf_rates[0]),
        "mean_batch_paged": round(batch["paged"], 2),
        "mean_batch_contiguous": round(batch["contiguous"], 2),
        "batch_ratio_paged_vs_contiguous": round(batch["paged"] / batch["contiguous"], 2),
        "kv_pool_blocks": runtime.pool.num_blocks,
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    print(json.dumps(summary))


def print_summary(results: dict, batch: dict, threshold: float) -> None:
    rates = sorted({r for v in results.values() for r in v["curve"]})
    print("\nnormalized latency (s/token; - = not run, above the threshold already)")
    print("system      " + "".join(f"{r:>8.3g}" for r in rates) + "   sustained")
    for name, v in results.items():
        cells = "".join(f"{v['curve'][r]:8.3f}" if r in v["curve"] else f"{'-':>8}" for r in rates)
        print(f"{name:<12}{cells}   {v['sustained_rate']:.3g} req/s")
    print(
        f"mean batch size at saturation, same KV pool: paged {batch['paged']:.1f}, "
        f"contiguous {batch['contiguous']:.1f}"
    )


if __name__ == "__main__":
    main()
