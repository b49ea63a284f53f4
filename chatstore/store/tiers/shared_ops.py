"""What ChunkTiers asks of the shared tier (Redis) alone, never on the engine's thread: learn
which chunks it holds (after a restart), and the only removals of shared chunks there are, each
explicit: a shared flush and a tenant's crypto-shred. A replica that stops using a chunk only
forgets it (ChunkTiers.delete): Redis's maxmemory policy and TTL evict (redis.py). And the
chunks a replica uses from its own tiers are kept warm there (`refresh_shared`): under
`allkeys-lru` a shared system prompt every replica serves from its DRAM would otherwise look
unused to Redis and go first."""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection

from chatstore.store.events import StoreCounters
from chatstore.store.session_kv import ChunkKey
from chatstore.store.tiers.base import StorageTier

log = logging.getLogger(__name__)


class SharedTierOps:
    """A base of ChunkTiers (the state below is ChunkTiers')."""

    slow: list[StorageTier]
    counters: StoreCounters
    _lock: threading.RLock
    _io_lock: threading.Lock

    def contains(self, key: ChunkKey) -> bool:
        raise NotImplementedError

    def _clear_shared(self, tier: StorageTier, tenant: str | None = None) -> int:
        clear = getattr(tier, "clear_shared", None)
        if clear is None:
            return 0
        with self._io_lock:
            try:
                return int(clear(tenant))
            except Exception:
                log.exception("clearing the %s tier failed", tier.name)
                with self._lock:
                    self.counters.tier(tier.name).errors += 1
                return 0

    def discover_shared(self, keys: list[ChunkKey], batch: int = 1000) -> int:
        """Learn which of keys the shared tier holds (after a restart: the chunks the records
        list and no local tier holds), one pipelined round per `batch`; how many it has. Not
        for the engine's thread; an unreachable Redis learns nothing (they read as misses)."""
        found = 0
        for tier in self.slow:
            discover = getattr(tier, "discover", None)
            if not tier.remote or discover is None:
                continue
            todo = [k for k in keys if not self.contains(k)]
            for start in range(0, len(todo), batch):
                try:
                    found += int(discover(todo[start : start + batch]))
                except Exception as exc:  # TierUnavailable: a miss each, recomputed
                    log.warning(
                        "could not look up %d chunks in the %s tier: %s", len(todo), tier.name, exc
                    )
                    break
        return found

    def refresh_shared(self, keys: list[ChunkKey], copy_unknown: Collection[ChunkKey] = ()) -> int:
        """Tell the shared tier keys are in use (a turn's chain reused them from a local tier):
        their TTL and LRU clock move (one pipelined EXPIRE round for the keys it is known to
        hold); how many it still holds. Those of `copy_unknown` it is not known to hold yet
        (their write-back is not done: a burst of turns defers it) are copied there now from
        host memory (the caller passes shared chunks: written after the burst, a system prompt
        would look older to Redis's LRU than the sessions' own tails). Never raises."""
        held = 0
        for tier in self.slow:
            refresh = getattr(tier, "refresh", None)
            if not tier.remote or refresh is None:
                continue
            known, unknown = [], []
            for k in keys:
                if tier.contains(k):
                    known.append(k)
                elif k in copy_unknown:
                    unknown.append(k)
            try:
                held += int(refresh(known))
                held += sum(self._copy_down(k, tier) for k in unknown)
            except Exception as exc:  # TierUnavailable
                log.debug("could not refresh chunks in the %s tier: %s", tier.name, exc)
        return held

    def _copy_down(self, key: ChunkKey, tier: StorageTier) -> bool:
        raise NotImplementedError

    def delete_tenant_shared(self, tenant: str) -> int:
        """Remove every chunk of tenant from the shared tier (a crypto-shred); how many."""
        return sum(self._clear_shared(t, tenant) for t in self.slow if t.remote)
