"""ChunkTiers' writes into the slow tiers (SSD, remote), all holding `_io_lock`: a DRAM victim
written down (`_land`), the room a slow tier makes by moving its own victims further down
(`_make_room`), the counters a refused or failed write leaves; and the slow read that counts a
corrupt or unopenable value. Locks as in chunk_tiers.py: `_io_lock` before `_lock`, no I/O
under `_lock`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Iterable

from chatstore.store.events import EventLog, StoreCounters
from chatstore.store.placement.victims import VictimChooser
from chatstore.store.port_values import EventKind, StoreEvent
from chatstore.store.sealing import OpenError
from chatstore.store.session_kv import ChunkKey, SessionKV
from chatstore.store.tiers.base import StorageFull, StorageTier, TierFull, TierUnavailable
from chatstore.store.tiers.codec import CorruptValueError

log = logging.getLogger(__name__)


class SlowTierWrites:
    """The slow-tier half of ChunkTiers (its base: the state below is ChunkTiers')."""

    top: StorageTier | None
    slow: list[StorageTier]
    placement: VictimChooser
    events: EventLog
    counters: StoreCounters
    _lock: threading.RLock
    _io_lock: threading.Lock
    _transit: dict[ChunkKey, SessionKV]

    def pick_victim(self, tier: StorageTier, exclude: Collection[ChunkKey]) -> ChunkKey | None:
        """The chunk the placement gives up first in tier, never one in exclude (under
        `_lock`): what every eviction asks, once per chunk it evicts. A placement with
        `victim` keeps its order as the tiers change; any other VictimChooser ranks the
        tier's keys each time."""
        victim = getattr(self.placement, "victim", None)
        if victim is not None:
            chosen: ChunkKey | None = victim(tier, exclude)
            return chosen
        candidates = [k for k in tier.keys() if k not in exclude]  # noqa: SIM118
        return self.placement.choose_victim(tier.name, candidates)

    def _read_slow(self, tier: StorageTier, key: ChunkKey) -> SessionKV | None:
        if not tier.contains(key):
            return None
        try:
            return tier.get(key)
        except TierUnavailable:
            pass  # out of reach now (the tier's breaker counts it): a miss
        except OpenError:
            # A wrong, shredded or missing key, or a clear or changed value: a miss, counted as
            # corrupt (not served) and said why. The value stays where it is (the tiers never
            # drop one that does not open): another key, a replica's or a rotation's, may.
            with self._lock:
                self.counters.tier(tier.name).corrupt += 1
                self.counters.tier(tier.name).open_failures += 1
            self._emit("corrupt", key, tier.name)
        except CorruptValueError:
            with self._lock:
                self.counters.tier(tier.name).corrupt += 1
            self._emit("corrupt", key, tier.name)
        except Exception:
            log.exception("reading chunk %s from the %s tier failed", key, tier.name)
            with self._lock:
                self.counters.tier(tier.name).errors += 1
        return None

    def _land(self, parked: list[tuple[ChunkKey, SessionKV]]) -> None:
        with self._io_lock:
            for key, value in parked:
                with self._lock:
                    if self._transit.get(key) is not value:
                        continue  # deleted (or read back up) meanwhile
                try:
                    landed = self._write_down(key, value, self.slow)
                except Exception:
                    log.exception("writing chunk %s down failed", key)
                    landed = None
                with self._lock:
                    current = self._transit.get(key) is value
                    if current:
                        del self._transit[key]
                        if landed is not None:
                            self.counters.bytes_down += value.nbytes
                if landed is not None and not current:
                    self._delete_slow(key)  # deleted while it was being written

    def _write_down(
        self, key: ChunkKey, value: SessionKV, levels: Iterable[StorageTier], drop: bool = True
    ) -> str | None:
        """value into the first of `levels` that takes it (making room there); its name. When
        none does, the chunk is dropped, unless `drop` is False (a copy of a chunk that stays
        in DRAM). A write the storage refuses is counted (TierCounters.write_failures)."""
        for tier in levels:
            if tier.contains(key) and not tier.remote:
                return tier.name
            need = tier.footprint(value)
            try:
                # The shared tier is Redis's to evict (its maxmemory policy): no room made
                # there, no budget; a put of a chunk it has refreshes the chunk's TTL.
                local = not tier.remote
                if local and (need > tier.capacity or not self._make_room(tier, key, need)):
                    continue
                tier.put(key, value)
            except StorageFull as exc:  # the tier logged it and now counts as full
                self._write_failed(tier, exc.reason)
                continue
            except (TierFull, TierUnavailable):
                continue
            except Exception:
                log.exception("writing chunk %s to the %s tier failed", key, tier.name)
                self._write_failed(tier, "error")
                continue
            self._emit("demoted", key, tier.name, value.nbytes)
            return tier.name
        if drop:
            self._dropped(key, value.nbytes)
        return None

    def _write_failed(self, tier: StorageTier, reason: str) -> None:
        with self._lock:
            counters = self.counters.tier(tier.name)
            counters.write_failures[reason] = counters.write_failures.get(reason, 0) + 1
            if reason == "error":
                counters.errors += 1

    def _make_room(self, tier: StorageTier, key: ChunkKey, need: int) -> bool:
        """Evict from a local tier (its budget) until need fits; never called for the shared
        tier, whose chunks no replica picks as victims."""
        below = self.slow[self.slow.index(tier) + 1 :]
        while tier.used_bytes() + need > tier.capacity:
            with self._lock:
                victim = self.pick_victim(tier, (key,))
                if victim is None:
                    return False
                self.counters.tier(tier.name).evictions += 1
                elsewhere = (
                    self.top is not None and self.top.contains(victim)
                ) or victim in self._transit
            self._emit("evicted", victim, tier.name)
            if not elsewhere and not any(t.contains(victim) for t in below):
                value = self._read_slow(tier, victim)
                if value is not None and below:
                    self._write_down(victim, value, below)
                elif value is not None:
                    self._dropped(victim, value.nbytes)
            before = tier.used_bytes()
            tier.delete(victim)
            if tier.used_bytes() >= before:
                return False  # no progress: do not spin
        return True

    def _delete_slow(self, key: ChunkKey) -> None:
        """key leaves the local slow tiers; the shared tier only forgets it (tier.delete)."""
        for tier in self.slow:
            try:
                tier.delete(key)
            except Exception:
                log.exception("deleting chunk %s from the %s tier failed", key, tier.name)

    def _dropped(self, key: ChunkKey, nbytes: int) -> None:
        with self._lock:
            self.counters.dropped += 1
        self._emit("dropped", key, None, nbytes)

    def _emit(
        self, kind: EventKind, key: ChunkKey, tier: str | None = None, nbytes: int = 0
    ) -> None:
        self.events.emit(StoreEvent(kind, key, tier, nbytes))
