"""Chunks across the tiers, fastest first: DRAM, then LMDB (SSD), then Redis (remote).

    put ──► DRAM ──evict──► SSD ──evict──► remote ──evict──► dropped
    get ◄── fastest tier holding the chunk; a hit below DRAM is copied up (promoted)

A chunk is immutable (its key hashes its content), which makes the hierarchy simple: a copy is
valid wherever it is, so a chunk may sit in several tiers at once. A promotion leaves the copy
below in place, a write-back (`persist`) copies a DRAM chunk to SSD without moving it, and an
eviction from DRAM of a chunk that has a copy below just frees the DRAM blocks. Only a chunk with
no copy below is written down when evicted, and a chunk leaves a slow tier for the next one
only when it has no copy further down.

Locks. `_lock` (RLock) guards what lives in memory: the DRAM tier, `_transit` (chunks evicted
from DRAM and being written down: still readable), counters and the placement; no I/O ever
happens under it. `_io_lock` serialises writes into slow tiers (one thread at a time; taken
before `_lock`, never while holding it), so it may be held across a Redis call (bounded by the
client's timeout and the tier's circuit breaker). Reads of slow tiers need neither lock (LMDB
MVCC, a thread-safe Redis pool).

The engine thread never waits for `_io_lock` nor for Redis: its reads run inside `foreground()`,
where the remote tier is skipped (a miss: the caller recomputes and hints a prefetch, which
brings the chunk to DRAM off the engine thread) whenever a DRAM tier exists, and where the
write-down of victims a promotion evicts is queued to a background thread (BackgroundIO).

The owner (AttentionStore) decides which chunks exist: `wanted(key)` says whether any session
references a chunk, and a chunk read from a slow tier is copied up only while it is wanted, so a
promotion racing with a delete never brings a freed chunk back.

Parts: this file reads, stores, copies and deletes across the tiers; dram_admission.py admits
into DRAM and evicts from it; slow_writes.py writes into the slow tiers and makes room there;
shared_ops.py holds what only the shared tier (Redis) is asked: discover, flush, shred.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from chatstore.store.events import EventLog, StoreCounters
from chatstore.store.placement.victims import LruChooser, VictimChooser
from chatstore.store.session_kv import ChunkKey, SessionKV
from chatstore.store.tiers.background import BackgroundIO
from chatstore.store.tiers.base import (
    StorageTier,
    TierOccupancy,
)
from chatstore.store.tiers.dram import DramTier
from chatstore.store.tiers.dram_admission import DramAdmission
from chatstore.store.tiers.shared_ops import SharedTierOps

log = logging.getLogger(__name__)


class ChunkTiers(SharedTierOps, DramAdmission):
    def __init__(
        self,
        tiers: list[StorageTier],
        placement: VictimChooser | None = None,
        events: EventLog | None = None,
        wanted: Callable[[ChunkKey], bool] = lambda key: True,
    ) -> None:
        if not tiers:
            raise ValueError("the store needs at least one tier")
        if any(t.in_memory for t in tiers[1:]):
            raise ValueError("only the first tier may be an in-memory tier")
        self.tiers = tiers
        self.top: StorageTier | None = tiers[0] if tiers[0].in_memory else None
        self.slow = [t for t in tiers if not t.in_memory]
        self.placement = placement or LruChooser()
        self.events = events or EventLog()
        self.counters = StoreCounters()
        self.wanted = wanted
        self._lock = threading.RLock()
        self._io_lock = threading.Lock()
        self._transit: dict[ChunkKey, SessionKV] = {}
        self._local = threading.local()  # .foreground: this thread must not wait on slow I/O
        self._background = BackgroundIO()
        bind = getattr(self.placement, "bind_tiers", None)
        if bind is not None:  # the placement follows the tiers' changes (chunk_placement.py)
            bind(tiers, self._lock)

    @contextmanager
    def foreground(self) -> Iterator[None]:
        """The calling thread's reads, inside, are latency-critical (the engine's): the remote
        tier is not read when a DRAM tier can hold its chunks instead (a miss; the prefetch
        thread brings them up), and promotions leave writing their victims down to a
        background thread instead of waiting for `_io_lock`."""
        before = self._in_foreground()
        self._local.foreground = True
        try:
            yield
        finally:
            self._local.foreground = before

    def _readable(self, tier: StorageTier) -> bool:
        return not (tier.remote and self.top is not None and self._in_foreground())

    # -- where ------------------------------------------------------------------------------

    def where(self, key: ChunkKey) -> str | None:
        """The fastest tier holding key (a chunk on its way down counts as DRAM), or None."""
        with self._lock:
            if self.top is not None and (self.top.contains(key) or key in self._transit):
                return self.top.name
        return next((t.name for t in self.slow if t.contains(key)), None)

    def contains(self, key: ChunkKey) -> bool:
        return self.where(key) is not None

    # -- reads ------------------------------------------------------------------------------

    def get(
        self,
        key: ChunkKey,
        promote: bool = True,
        count: bool = True,
        rows: tuple[int, int] | None = None,
    ) -> SessionKV | None:
        """key's chunk from the fastest tier holding it (copied up to DRAM when promote);
        count: a use, counted as a hit or miss (not for the store's own re-reads); rows:
        only rows [start, end) are wanted (from DRAM only those are copied)."""
        with self._lock:
            top = self.top
            if rows is not None and isinstance(top, DramTier) and top.contains(key):
                value = top.get_rows(key, *rows)
                if value is not None and count:
                    self._hit(top.name, key, value.nbytes)
                return value
            value = self._get_memory(key) if count else self._get_memory_quiet(key)
            if value is not None:
                return _rows(value, rows)
        for tier in self.slow:
            value = self._read_slow(tier, key) if self._readable(tier) else None
            if value is None:
                continue
            source = tier.name
            promoted = promote and self.top is not None
            if promoted and self._insert_top(key, value, "promoted") == "present":
                source = self.tiers[0].name  # another thread brought it up meanwhile
            if count:
                self._hit(source, key, value.nbytes)
            return _rows(value, rows)
        if count:
            with self._lock:
                self.counters.misses += 1
            self._emit("miss", key)
        return None

    def prefetch(self, key: ChunkKey) -> bool:
        """Copy key up to DRAM ahead of use; True if it moved."""
        if self.top is None:
            return False
        with self._lock:
            if self.top.contains(key) or key in self._transit:
                return False
        for tier in self.slow:
            value = self._read_slow(tier, key)
            if value is not None:
                moved = self._insert_top(key, value, "prefetched") is True
                if moved:
                    with self._lock:
                        self.counters.prefetches += 1
                return moved
        return False

    def count_pending_hit(self, key: ChunkKey) -> None:
        """A read served from the write buffer: a hit in the first tier."""
        self._hit(self.tiers[0].name, key, 0)

    def _get_memory(self, key: ChunkKey) -> SessionKV | None:
        value = self._get_memory_quiet(key)
        if value is not None:
            self._hit(self.tiers[0].name, key, value.nbytes)
        return value

    def _hit(self, tier: str, key: ChunkKey, nbytes: int) -> None:
        with self._lock:
            self.counters.tier(tier).hits += 1
            self.placement.touch(key)
        self._emit("hit", key, tier, nbytes)

    # -- writes -----------------------------------------------------------------------------

    def put(self, key: ChunkKey, value: SessionKV) -> str | None:
        """Store a new chunk (a no-op where it is stored already); the tier it is in."""
        where = self.where(key)
        if where is not None:
            return where
        if self.top is not None and self._insert_top(key, value, "stored") is not False:
            return self.top.name
        with self._io_lock:
            landed = self._write_down(key, value, self.slow)
        if landed is not None:
            self._emit("stored", key, landed, value.nbytes)
        return landed

    def put_extension(
        self, key: ChunkKey, base: ChunkKey, keep: int, rows: SessionKV, may_take_base: bool
    ) -> tuple[str | None, int]:
        """Store chunk `key` = the first `keep` rows of chunk `base` + rows; (its tier, bytes
        written). With may_take_base (nobody holds base any more) and base in DRAM, the DRAM
        tier re-labels base's blocks and writes only `rows` into them; otherwise the chunk
        is assembled from a read of base and stored whole."""
        where = self.where(key)
        if where is not None:
            return where, 0
        if may_take_base and self._extend_top(key, base, keep, rows):
            assert self.top is not None
            return self.top.name, rows.nbytes
        value = self.get(base, promote=False, count=False)
        if value is None:
            log.warning("chunk %s: its base %s is gone; not stored", key, base)
            return None, 0
        kv = torch.cat([value.kv[:, :, :keep], rows.kv.to(value.dtype)], dim=2)
        whole = SessionKV(value.token_ids[:keep] + rows.token_ids, kv)
        return self.put(key, whole), whole.nbytes

    def persist(self, key: ChunkKey) -> bool:
        """Write-back: copy a DRAM chunk to the first slow tier as well (it stays in DRAM);
        True when a slow tier holds it afterwards."""
        return bool(self.slow) and self._copy_down(key, self.slow[0])

    def share(self, key: ChunkKey) -> bool:
        """Copy a DRAM chunk to the remote tier too (other replicas read it there); True
        when the remote tier holds it afterwards. A no-op without a remote tier."""
        remote = next((t for t in self.slow if t.remote), None)
        return remote is not None and self._copy_down(key, remote)

    def _copy_down(self, key: ChunkKey, tier: StorageTier) -> bool:
        if tier.contains(key) and not tier.remote:
            return True
        with self._lock:
            value = self._get_memory_quiet(key)
        if value is None:
            return tier.contains(key)
        with self._io_lock:  # a copy: the chunk stays in DRAM if the tier refuses it
            return self._write_down(key, value, [tier], drop=False) is not None

    def _get_memory_quiet(self, key: ChunkKey) -> SessionKV | None:
        top = self.top
        if top is None:
            return None
        return top.get(key) if top.contains(key) else self._transit.get(key)

    def delete(self, key: ChunkKey) -> bool:
        """Remove key from every local tier; the shared tier (Redis) only forgets it here, as
        another replica may still use it (Redis's maxmemory policy and TTL evict it). True if
        it was stored."""
        with self._lock:
            found = False
            if self.top is not None:
                found = self.top.delete(key)
            found = self._transit.pop(key, None) is not None or found
            self.placement.forget(key)
        with self._io_lock:
            for tier in self.slow:
                try:
                    found = tier.delete(key) or found
                except Exception:
                    log.exception("deleting chunk %s from the %s tier failed", key, tier.name)
                    with self._lock:
                        self.counters.tier(tier.name).errors += 1
        if found:
            self._emit("deleted", key)
        return found

    def clear(self, shared: bool = False) -> int:
        """Drop every chunk of this replica's tiers; with `shared`, every chunk of this model
        in the shared tier too (every replica's: an explicit flush). How many chunks the
        shared tier removed."""
        removed = 0
        if shared:
            for tier in self.slow:
                if tier.remote:
                    removed += self._clear_shared(tier)
        self._clear_local()
        return removed

    def _clear_local(self) -> None:
        keys: set[ChunkKey] = set()
        with self._lock:
            for tier in self.tiers:
                keys.update(tier.keys())
            keys.update(self._transit)
        for key in keys:
            self.delete(key)

    def demote_all(self) -> None:
        """Every DRAM chunk without a copy below is written down (graceful shutdown)."""
        self.drain_background()
        if self.top is None or not self.slow:
            return
        for key in self.top.keys():  # noqa: SIM118 (a tier, not a dict)
            self.persist(key)

    # -- state ------------------------------------------------------------------------------

    @property
    def lock(self) -> threading.RLock:
        return self._lock

    def stats_occupancy(self) -> list[TierOccupancy]:
        with self._lock:
            return [t.occupancy() for t in self.tiers]

    def keys(self) -> set[ChunkKey]:
        with self._lock:
            keys = set(self._transit)
            for tier in self.tiers:
                keys.update(tier.keys())
            return keys

    def check_capacity(self) -> None:
        for tier in self.tiers:
            if tier.remote:
                continue  # Redis's maxmemory bounds the shared tier, not our count
            used = tier.used_bytes()
            assert used <= tier.capacity, f"{tier.name}: {used} bytes used > {tier.capacity}"


def _rows(value: SessionKV, rows: tuple[int, int] | None) -> SessionKV:
    if rows is None:
        return value
    start, end = rows
    return SessionKV(value.token_ids[start:end], value.kv[:, :, start:end])
