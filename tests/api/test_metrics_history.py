"""The dashboard's time series (metrics_history.py): per-interval rates from cumulative
counters, TTFT percentiles per interval, a bounded buffer, and the sampler's loop."""

from __future__ import annotations

import asyncio

from chatstore.api.admin.history import MetricsHistory, percentile, run_sampler
from chatstore.engine.engine_stats import EngineStats
from chatstore.store.ports import TierStats

ENGINE = EngineStats(
    **{
        **{name: 0 for name in EngineStats.__dataclass_fields__},
        "mean_batch_size": 0.0,
        "waiting": 2,
        "running": 3,
        "num_blocks": 100,
        "free_blocks": 75,
    }
)


def tier(name: str, hits: int, misses: int, used: int = 10) -> TierStats:
    return TierStats(name, 1000, used, 1, hits, misses, 0, 0, 0, 0)


def test_percentile_is_nearest_rank():
    assert percentile([], 0.5) is None
    assert percentile([3.0], 0.9) == 3.0
    values = [float(v) for v in range(1, 11)]  # 1..10
    assert (percentile(values, 0.5), percentile(values, 0.9)) == (5.0, 9.0)
    assert percentile(list(reversed(values)), 1.0) == 10.0


def test_samples_hold_interval_rates_and_ttfts():
    history = MetricsHistory()
    first = history.sample([tier("dram", 5, 5), tier("ssd", 0, 0)], ENGINE, now=100.0)
    assert (first.hits, first.misses, first.hit_rate, first.turns) == (0, 0, None, 0)
    assert (first.waiting, first.running, first.block_usage) == (2, 3, 0.25)
    for seconds in (0.010, 0.030, 0.020):
        history.record_ttft(seconds)
    second = history.sample([tier("dram", 8, 6), tier("ssd", 1, 0)], ENGINE, now=102.0)
    assert (second.hits, second.misses, second.hit_rate) == (4, 1, 0.8)
    assert (second.turns, second.ttft_p50_ms, second.ttft_p90_ms) == (3, 20.0, 30.0)
    assert [t.name for t in second.tiers] == ["dram", "ssd"]
    quiet = history.sample([tier("dram", 8, 6), tier("ssd", 1, 0)], None, now=104.0)
    assert (quiet.hit_rate, quiet.turns, quiet.ttft_p50_ms, quiet.block_usage) == (
        None, 0, None, None,
    )  # fmt: skip
    assert [s.t for s in history.since(100.0)] == [102.0, 104.0]
    assert len(history.since(None)) == 3


def test_a_counter_reset_reads_as_no_activity_and_the_buffer_is_bounded():
    history = MetricsHistory(max_samples=3)
    history.sample([tier("dram", 50, 50)], ENGINE, now=1.0)
    reset = history.sample([tier("dram", 1, 0)], ENGINE, now=2.0)  # a flush, a new store
    assert (reset.hits, reset.misses, reset.hit_rate) == (0, 0, None)
    for t in range(3, 10):
        history.sample([tier("dram", 1, 0)], ENGINE, now=float(t))
    assert [s.t for s in history.since(None)] == [7.0, 8.0, 9.0]


def test_the_sampler_samples_until_cancelled_and_survives_a_failing_source():
    history = MetricsHistory()
    calls = {"n": 0}

    def tiers() -> list[TierStats]:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("store busy")
        return [tier("dram", calls["n"], 0)]

    async def main() -> None:
        task = asyncio.create_task(run_sampler(history, tiers, lambda: ENGINE, interval_s=0.01))
        while calls["n"] < 5:
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(main())
    assert len(history.since(None)) >= 3  # every call but the failing one made a sample
