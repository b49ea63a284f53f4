"""What the store tells the outside: events as they happen, counters any time.

Metrics and the admin endpoint read these (`AttentionStore.stats()`, `add_listener`); nothing
else reaches into the tiers.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field

from chatstore.store.port_values import Listener, StoreEvent
from chatstore.store.tiers.base import TierOccupancy
from chatstore.store.tiers.breaker import BreakerHealth


@dataclass
class TierCounters:
    hits: int = 0
    evictions: int = 0  # sessions moved out of this tier to make room
    corrupt: int = 0  # values dropped because they failed their checksum
    open_failures: int = 0  # sealed values that failed to open (encryption at rest): dropped
    errors: int = 0  # writes into this tier that raised (the value went elsewhere or stayed)
    # Writes this tier did not take, by reason: map_full / disk_full (its storage refused it:
    # a copy stays in DRAM and the write-back tries again), error (it raised: also in errors).
    write_failures: dict[str, int] = field(default_factory=dict)

    def copy(self) -> TierCounters:
        return dataclasses.replace(self, write_failures=dict(self.write_failures))


@dataclass
class StoreCounters:
    tiers: dict[str, TierCounters] = field(default_factory=dict)
    misses: int = 0
    bytes_up: int = 0  # promoted toward DRAM (on use or prefetch)
    bytes_down: int = 0  # demoted toward SSD / remote on eviction
    prefetches: int = 0
    dropped: int = 0  # sessions that fell off the last tier

    def tier(self, name: str) -> TierCounters:
        return self.tiers.setdefault(name, TierCounters())


@dataclass(frozen=True)
class StoreStats:
    occupancy: list[TierOccupancy]
    counters: StoreCounters
    first_tier: str = ""  # the store's fastest tier (misses and moves are counted there)
    remote: BreakerHealth | None = None  # the remote tier's circuit breaker (None: no remote)

    def as_dict(self) -> dict:
        c = self.counters
        out = {
            "tiers": [
                {
                    "name": o.name,
                    "used_bytes": o.used_bytes,
                    "capacity_bytes": o.capacity_bytes,
                    "sessions": o.num_sessions,
                    "hits": c.tier(o.name).hits,
                    "evictions": c.tier(o.name).evictions,
                    "corrupt": c.tier(o.name).corrupt,
                    "open_failures": c.tier(o.name).open_failures,
                    "errors": c.tier(o.name).errors,
                    "write_failures": dict(c.tier(o.name).write_failures),
                }
                for o in self.occupancy
            ],
            "misses": c.misses,
            "bytes_up": c.bytes_up,
            "bytes_down": c.bytes_down,
            "prefetches": c.prefetches,
            "dropped": c.dropped,
        }
        if self.remote is not None:
            out["remote"] = dataclasses.asdict(self.remote)
        return out


class EventLog:
    """Fan-out to listeners plus a bounded list of recent events."""

    def __init__(self, keep: int = 1000) -> None:
        self.recent: deque[StoreEvent] = deque(maxlen=keep)
        self._listeners: list[Listener] = []

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def emit(self, event: StoreEvent) -> None:
        self.recent.append(event)
        for listener in self._listeners:
            listener(event)
