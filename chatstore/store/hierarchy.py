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
        """Store value as key's KV (replacing any old one); the tier it landed in, or None.

        The old value is replaced, not removed first: in the tier the new one lands in, the
        tier's own put swaps them atomically (LMDB: one write transaction), and copies in other
        tiers go only after it landed. A crash mid-put leaves the old or the new value."""
        with self._lock:
            self.chooser.touch(key)
            landed = self._place(key, value, 0, "stored")
            for tier in self.tiers:
                if tier.name != landed:
                    tier.delete(key)
            return landed

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

    def prefetch(self, key: SessionKey, touch: bool = False) -> bool:
        """Move key up to tier 0 ahead of use (scheduler-aware fetch); True if it moved.

        touch: count it as used (an explicit hint), so the chooser does not send it back down
        before its turn comes. A chooser with `ranked_below(key, keys)` (PolicyChooser) vetoes a
        prefetch that would push out a session it values at least as much as key."""
        with self._lock:
            for level, tier in enumerate(self.tiers[1:], start=1):
                if not tier.contains(key):
                    continue
                if touch:
                    self.chooser.touch(key)
                if not self._room_below(key, 1):  # cheap veto before reading it
                    return False
                value = self._read(tier, key)
                if value is None or not self._room_below(key, self.tiers[0].footprint(value)):
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

    @property
    def lock(self) -> threading.RLock:
        """The lock every public method holds (for callers that combine several reads)."""
        return self._lock  # type: ignore[return-value]

    def mean_kv_bytes(self) -> float:
        """S_kv: mean bytes of a stored session over all tiers (0 when empty)."""
        with self._lock:
            n = sum(len(t.keys()) for t in self.tiers)
            return sum(t.used_bytes() for t in self.tiers) / n if n else 0.0

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

    def _room_below(self, key: SessionKey, nbytes: int) -> bool:
        """Whether tier 0 can take about nbytes for key by evicting only sessions the chooser
        values less than key (always True for a chooser without `ranked_below`)."""
        ranked_below = getattr(self.chooser, "ranked_below", None)
        top = self.tiers[0]
        need = nbytes - (top.capacity - top.used_bytes())
        if ranked_below is None or need <= 0:
            return True
        lower = ranked_below(key, [k for k in top.keys() if k != key])  # noqa: SIM118
        return sum(top.size_of(k) for k in lower) >= need

    def _make_room(self, level: int, value: SessionKV, key: SessionKey) -> bool:
        tier = self.tiers[level]
        need = tier.footprint(value) - tier.size_of(key)  # a value it replaces frees its room
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
