"""ChunkTiers' first tier (DRAM): a chunk admitted by the placement (`_insert_top`, making
room by evicting its victims), a chunk extended in place from its base's blocks
(`_extend_top`), and the victims an eviction leaves: dropped when nothing is below, freed when
a copy is below, else parked in `_transit` (still readable) and written down by the calling
thread, or by the background thread when the caller is the engine's (`foreground`).

Everything that touches DRAM holds `_lock`; the write-down of parked victims runs after it is
released (locks as in chunk_tiers.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from chatstore.store.port_values import EventKind
from chatstore.store.session_kv import ChunkKey, SessionKV
from chatstore.store.tiers.background import BackgroundIO
from chatstore.store.tiers.base import TierFull
from chatstore.store.tiers.dram import DramTier
from chatstore.store.tiers.slow_writes import SlowTierWrites


class DramAdmission(SlowTierWrites):
    """The DRAM half of ChunkTiers (its base; the state below is ChunkTiers')."""

    wanted: Callable[[ChunkKey], bool]
    _local: threading.local
    _background: BackgroundIO

    def _in_foreground(self) -> bool:
        return getattr(self._local, "foreground", False)

    def _insert_top(self, key: ChunkKey, value: SessionKV, kind: EventKind) -> bool | str:
        """value into DRAM, evicting by the placement; victims without a copy below are
        written down before this returns. True when inserted, "present" when DRAM held it
        already, False when it does not fit (or is no longer wanted: a delete raced with the
        read that brought it)."""
        top = self.top
        assert top is not None
        parked: list[tuple[ChunkKey, SessionKV]] = []
        try:
            with self._lock:
                if top.contains(key):
                    return "present"
                if not self.wanted(key):
                    return False
                # A prefetch must not push out something worth more than what it brings.
                incoming = key if kind == "prefetched" else None
                if not self._room_top(top.footprint(value), {key}, parked, incoming):
                    return False
                try:
                    top.put(key, value)
                except TierFull:
                    return False
                self.placement.touch(key)
                if kind != "stored":
                    self.counters.bytes_up += value.nbytes
            self._emit(kind, key, top.name, value.nbytes)
            return True
        finally:
            if parked:
                self._land_soon(parked)

    def _land_soon(self, parked: list[tuple[ChunkKey, SessionKV]]) -> None:
        """Write evicted chunks down now, or (a foreground thread) on the background thread:
        meanwhile they stay readable in `_transit`."""
        if self._in_foreground():
            self._background.submit(lambda: self._land(parked))
        else:
            self._land(parked)

    def drain_background(self, timeout: float | None = None) -> bool:
        """Until write-downs handed to the background thread have landed; False on timeout."""
        return self._background.drain(timeout)

    def _may_displace(self, incoming: ChunkKey, victim: ChunkKey) -> bool:
        check = getattr(self.placement, "may_displace", None)
        return check is None or check(incoming, victim)

    def _evict_top(self, victim: ChunkKey, parked: list[tuple[ChunkKey, SessionKV]]) -> None:
        top = self.top
        assert top is not None
        self.counters.tier(top.name).evictions += 1
        self._emit("evicted", victim, top.name)
        if any(t.contains(victim) for t in self.slow):
            top.delete(victim)  # a copy below already: nothing to write
            return
        value = top.get(victim)
        top.delete(victim)
        if value is None:
            return
        if not self.slow:
            self._dropped(victim, value.nbytes)
            return
        self._transit[victim] = value
        parked.append((victim, value))

    def _extend_top(self, key: ChunkKey, base: ChunkKey, keep: int, rows: SessionKV) -> bool:
        """Chunk `key` = the first `keep` rows of `base` + rows, made in DRAM by re-labelling
        base's blocks and writing only `rows` (base is nobody's any more); False when DRAM is
        not a DramTier, does not hold base, or cannot make the room."""
        top = self.top
        if not isinstance(top, DramTier):  # the one tier that extends in place
            return False
        parked: list[tuple[ChunkKey, SessionKV]] = []
        landed = False
        try:
            with self._lock:
                if top.contains(base) and self._room_top(
                    top.footprint_tokens(keep + rows.num_tokens) - top.size_of(base),
                    {key, base},
                    parked,
                ):
                    landed = top.extend(base, key, keep, rows)
                    if landed:
                        self.placement.touch(key)
        finally:
            if parked:
                self._land_soon(parked)
        if landed:
            self._emit("stored", key, top.name, rows.nbytes)
        return landed

    def _room_top(
        self,
        need: int,
        keep: set[ChunkKey],
        parked: list[tuple[ChunkKey, SessionKV]],
        incoming: ChunkKey | None = None,
    ) -> bool:
        """Evict from DRAM (under _lock) until `need` more bytes fit; never a key in keep,
        nor (with `incoming`) one the placement values above it."""
        top = self.top
        assert top is not None
        if need > top.capacity:
            return False
        while top.used_bytes() + need > top.capacity:
            victim = self.pick_victim(top, keep)
            if victim is None:
                return False
            if incoming is not None and not self._may_displace(incoming, victim):
                return False
            self._evict_top(victim, parked)
        return True
