"""Tiers from fastest to slowest; a session lives in exactly one of them.

    put ──► tier 0 (DRAM) ──evict──► tier 1 (SSD) ──evict──► tier 2 (remote) ──evict──► dropped
    get ◄── hit in tier i > 0: moved back up to tier 0 (which may push others down)

Room is made before a put: while the tier's used bytes + the value's footprint exceed capacity,
the victim chooser names a session and it moves one tier down (recursively). A value bigger than
a whole tier skips it. A value failing its checksum is dropped and counts as a miss. All public
methods hold one lock: the engine thread and the API thread may call at the same time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from chatstore.store.codec import CorruptValueError, FingerprintMismatch
from chatstore.store.events import EventLog, StoreCounters, StoreEvent, StoreStats
from chatstore.store.session_kv import SessionKey, SessionKV
from chatstore.store.tier import StorageTier, TierFull, TierOccupancy
from chatstore.store.victims import LruChooser, VictimChooser


class TierHierarchy:
    def __init__(
        self,
        tiers: list[StorageTier],
        chooser: VictimChooser | None = None,
        events: EventLog | None = None,
    ) -> None:
        if not tiers:
            raise ValueError("a hierarchy needs at least one tier")
        self.tiers = tiers
        self.chooser = chooser or LruChooser()
        self.events = events or EventLog()
        self.counters = StoreCounters()
        self.device_occupancy: Callable[[], TierOccupancy] | None = None
        self._lock = threading.RLock()

    def tier_of(self, key: SessionKey) -> str | None:
        with self._lock:
            for tier in self.tiers:
                if tier.contains(key):
                    return tier.name
            return None

    def put(self, key: SessionKey, value: SessionKV) -> str | None:
        """Store value as key's KV (replacing any old one); the tier it landed in, or None."""
        with self._lock:
            self._remove(key)
            self.chooser.touch(key)
            return self._place(key, value, 0, "stored")

    def get(self, key: SessionKey) -> SessionKV | None:
        """key's KV from the fastest tier holding it, moved up to tier 0; None on a miss."""
        with self._lock:
            for level, tier in enumerate(self.tiers):
                value = self._read(tier, key)
                if value is None:
                    continue
                self.counters.tier(tier.name).hits += 1
                self._emit("hit", key, tier.name, value.nbytes)
                self.chooser.touch(key)
                if level > 0:
                    self._move_up(level, key, value, "promoted")
                return value
            self.counters.misses += 1
            self._emit("miss", key)
            return None

    def prefetch(self, key: SessionKey) -> bool:
        """Move key up to tier 0 ahead of use (scheduler-aware fetch); True if it moved."""
        with self._lock:
            for level, tier in enumerate(self.tiers[1:], start=1):
                if not tier.contains(key):
                    continue
                value = self._read(tier, key)
                if value is None:
                    return False
                self.counters.prefetches += 1
                return self._move_up(level, key, value, "prefetched") == self.tiers[0].name
            return False

    def delete(self, key: SessionKey) -> bool:
        with self._lock:
            found = self._remove(key)
            self.chooser.forget(key)
            if found:
                self._emit("deleted", key)
            return found

    def clear(self) -> None:
        with self._lock:
            for tier in self.tiers:
                for key in tier.keys():  # noqa: SIM118 (a tier, not a dict)
                    self.chooser.forget(key)
                tier.clear()

    def demote_all(self, level: int = 0) -> None:
        """Move everything in tier `level` one tier down (graceful shutdown keeps DRAM on SSD)."""
        with self._lock:
            while self.tiers[level].keys():
                self._demote(level, self.tiers[level].keys()[0])

    def stats(self) -> StoreStats:
        with self._lock:
            occupancy = [t.occupancy() for t in self.tiers]
            if self.device_occupancy is not None:
                occupancy.insert(0, self.device_occupancy())
            return StoreStats(occupancy, _copy_counters(self.counters))

    def check_capacity(self) -> None:
        for tier in self.tiers:
            used = tier.used_bytes()
            assert used <= tier.capacity, f"{tier.name}: {used} bytes used > {tier.capacity}"

    # -- internals --------------------------------------------------------------------------

    def _read(self, tier: StorageTier, key: SessionKey) -> SessionKV | None:
        try:
            return tier.get(key)
        except (CorruptValueError, FingerprintMismatch):
            tier.delete(key)
            self.counters.tier(tier.name).corrupt += 1
            self._emit("corrupt", key, tier.name)
            return None

    def _move_up(self, level: int, key: SessionKey, value: SessionKV, kind: str) -> str | None:
        top = self.tiers[0]
        if top.footprint(value) > top.capacity:
            return self.tiers[level].name  # can never live higher up: leave it where it is
        self.tiers[level].delete(key)
        landed = self._place(key, value, 0, kind)
        if landed is not None and landed != self.tiers[level].name:
            self.counters.bytes_up += value.nbytes
        return landed

    def _place(self, key: SessionKey, value: SessionKV, level: int, kind: str) -> str | None:
        for i in range(level, len(self.tiers)):
            tier = self.tiers[i]
            if tier.footprint(value) > tier.capacity or not self._make_room(i, value, key):
                continue
            try:
                tier.put(key, value)
            except TierFull:
                continue
            self._emit(kind, key, tier.name, value.nbytes)  # type: ignore[arg-type]
            return tier.name
        self.counters.dropped += 1
        self.chooser.forget(key)
        self._emit("dropped", key, None, value.nbytes)
        return None

    def _make_room(self, level: int, value: SessionKV, key: SessionKey) -> bool:
        tier = self.tiers[level]
        need = tier.footprint(value)
        while tier.used_bytes() + need > tier.capacity:
            candidates = [k for k in tier.keys() if k != key]  # noqa: SIM118
            victim = self.chooser.choose_victim(tier.name, candidates)
            if victim is None:
                return False
            self._demote(level, victim)
        return True

    def _demote(self, level: int, victim: SessionKey) -> None:
        tier = self.tiers[level]
        value = self._read(tier, victim)
        tier.delete(victim)
        self.counters.tier(tier.name).evictions += 1
        self._emit("evicted", victim, tier.name)
        if value is None:
            self.chooser.forget(victim)
            return
        if level + 1 >= len(self.tiers):
            self.counters.dropped += 1
            self.chooser.forget(victim)
            self._emit("dropped", victim, None, value.nbytes)
            return
        if self._place(victim, value, level + 1, "demoted") is not None:
            self.counters.bytes_down += value.nbytes

    def _remove(self, key: SessionKey) -> bool:
        found = False
        for tier in self.tiers:
            found = tier.delete(key) or found
        return found

    def _emit(self, kind: str, key: SessionKey, tier: str | None = None, nbytes: int = 0) -> None:
        self.events.emit(StoreEvent(kind, key, tier, nbytes))  # type: ignore[arg-type]


def _copy_counters(c: StoreCounters) -> StoreCounters:
    from dataclasses import replace

    tiers = {name: replace(t) for name, t in c.tiers.items()}
    return replace(c, tiers=tiers)
