"""The last minutes of the cache, for the dashboard's plots (GET /admin/history: history_routes).

A sampler reads the same sources as /admin/cache (the store's tier stats, the engine's stats)
every `interval_s` into a bounded ring buffer; turn TTFTs arrive through Metrics.observe_turn
and are summarised per sample interval. Counters are turned into per-interval rates here, so a
plot shows what happened in the last seconds, not an average since start.

    sample k-1            sample k
        |── hits, misses, TTFTs observed ──|  -> hit_rate, ttft_p50_ms, ttft_p90_ms, turns

Nothing is sampled before the app starts nor after it stops (`sampling`, the history router's
lifespan, runs it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import FastAPI

from chatstore.api.admin.tiers import CacheTiers
from chatstore.engine.engine_stats import EngineStats
from chatstore.store.ports import TierStats, store_hits

log = logging.getLogger("chatstore.api")
DEFAULT_INTERVAL_S = 2.0
DEFAULT_SAMPLES = 450  # 15 minutes at the default interval

EngineStatsFn = Callable[[], EngineStats | None]
TierStatsFn = Callable[[], list[TierStats]]


@dataclass(frozen=True)
class TierSample:
    name: str
    used_bytes: int
    capacity_bytes: int
    sessions: int


@dataclass(frozen=True)
class Sample:
    t: float  # epoch seconds
    hit_rate: float | None  # hits / lookups over the interval; None without lookups
    hits: int  # over the interval, the store's tiers (as /admin/cache's hit_rate)
    misses: int
    turns: int  # turns that ended in the interval
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    waiting: int | None
    running: int | None
    block_usage: float | None  # device block pool, fraction in use
    tiers: tuple[TierSample, ...]


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 1]); None for no values."""
    if not values:
        return None
    ranked = sorted(values)
    return ranked[max(0, math.ceil(q * len(ranked)) - 1)]


class MetricsHistory:
    """A ring buffer of samples, appended by one sampler; `record_ttft` and `since` are safe
    from any thread."""

    def __init__(self, max_samples: int = DEFAULT_SAMPLES) -> None:
        self.samples: deque[Sample] = deque(maxlen=max_samples)
        self._ttfts: list[float] = []
        self._lock = threading.Lock()
        self._last_counts: tuple[int, int] | None = None  # (hits, misses) at the last sample

    def record_ttft(self, seconds: float) -> None:
        with self._lock:
            self._ttfts.append(seconds)

    def sample(
        self, tiers: list[TierStats], engine: EngineStats | None, now: float | None = None
    ) -> Sample:
        """Take one sample now from the given stats and append it."""
        with self._lock:
            ttfts, self._ttfts = self._ttfts, []
        hits, misses = store_hits(tiers)
        d_hits, d_misses = self._deltas(hits, misses)
        ms = [s * 1000 for s in ttfts]
        sample = Sample(
            t=time.time() if now is None else now,
            hit_rate=d_hits / (d_hits + d_misses) if d_hits + d_misses else None,
            hits=d_hits,
            misses=d_misses,
            turns=len(ttfts),
            ttft_p50_ms=_round(percentile(ms, 0.5)),
            ttft_p90_ms=_round(percentile(ms, 0.9)),
            waiting=getattr(engine, "waiting", None),
            running=getattr(engine, "running", None),
            block_usage=_round4(getattr(engine, "block_usage", None)),
            tiers=tuple(
                TierSample(t.name, t.used_bytes, t.capacity_bytes, t.sessions) for t in tiers
            ),
        )
        with self._lock:  # readers copy the buffer in another thread
            self.samples.append(sample)
        return sample

    def since(self, t: float | None) -> list[Sample]:
        with self._lock:
            samples = list(self.samples)
        return samples if t is None else [s for s in samples if s.t > t]

    def _deltas(self, hits: int, misses: int) -> tuple[int, int]:
        last, self._last_counts = self._last_counts, (hits, misses)
        if last is None or hits < last[0] or misses < last[1]:  # first sample, or a reset
            return 0, 0
        return hits - last[0], misses - last[1]


async def run_sampler(
    history: MetricsHistory,
    tiers: TierStatsFn,
    engine_stats: EngineStatsFn,
    interval_s: float = DEFAULT_INTERVAL_S,
) -> None:
    """Sample every interval until cancelled; the stats are read off the event loop."""
    while True:
        try:
            tier_stats, engine = await asyncio.to_thread(lambda: (tiers(), engine_stats()))
            history.sample(tier_stats, engine)
        except Exception:
            log.exception("sampling the cache history failed")
        await asyncio.sleep(interval_s)


@contextlib.asynccontextmanager
async def sampling(app: FastAPI) -> AsyncIterator[None]:
    """Router lifespan: run the sampler for the app's life (inside the app's own lifespan, so
    the engine is started first and stopped after)."""
    service = app.state.service
    tiers = CacheTiers(service.engine, service.store)
    task = asyncio.create_task(run_sampler(app.state.metrics.history, tiers, service.engine.stats))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _round4(share: float | None) -> float | None:
    return None if share is None else round(share, 4)


def _round(ms: float | None) -> float | None:
    return None if ms is None else round(ms, 3)
