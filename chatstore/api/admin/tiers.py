"""The cache's tiers as /admin/cache, /metrics and the history show them: the device tier (the
engine's block pool and prefix cache, also with kv_store = "off") first, then the store's."""

from __future__ import annotations

from typing import Protocol

from chatstore.engine.engine_stats import EngineStats
from chatstore.store.ports import DEVICE_TIER, SessionKVAdmin, TierStats


def device_tier(stats: EngineStats) -> TierStats:
    """The engine's block pool as the fastest tier, every number the engine's own (one
    snapshot, no counter of its own here):

    used_bytes  blocks holding KV, in use or free and still prefix-cached, x bytes per block
    sessions    sessions whose history is in the prefix cache (BlockManager's module doc: the
                last full block a session computed or reused is still cached, and with it every
                block before it)
    hits        full prompt blocks found in the prefix cache at admission (engine prefix_hits)
    misses      full prompt blocks looked up and not found (engine prefix_misses)
    evictions   cached blocks reused for other content (engine prefix_evictions)

    KV loaded into the pool from the store is counted by the store's tiers and the engine's
    kv_loads, not here (bytes_up, bytes_down and prefetches stay 0)."""
    block = stats.block_bytes
    return TierStats(
        name=DEVICE_TIER,
        capacity_bytes=stats.num_blocks * block,
        used_bytes=stats.kv_blocks * block,
        sessions=stats.cached_sessions,
        hits=stats.prefix_hits,
        misses=stats.prefix_misses,
        bytes_up=0,
        bytes_down=0,
        evictions=stats.prefix_evictions,
        prefetches=0,
    )


def cache_tiers(engine_stats: EngineStats, store: SessionKVAdmin) -> list[TierStats]:
    """The device tier, then the store's tiers, fastest first."""
    return [device_tier(engine_stats), *store.tier_stats()]


class StatsSource(Protocol):
    """The engine as the tiers read it."""

    def stats(self) -> EngineStats: ...


class CacheTiers:
    """`cache_tiers` read anew at each call (the metrics' scrape, the history's sampler)."""

    def __init__(self, engine: StatsSource, store: SessionKVAdmin) -> None:
        self.engine, self.store = engine, store

    def __call__(self) -> list[TierStats]:
        return cache_tiers(self.engine.stats(), self.store)
