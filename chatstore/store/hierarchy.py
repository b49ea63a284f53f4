"""Tiers from fastest to slowest; a session lives in exactly one of them.

    put ──► tier 0 (DRAM) ──evict──► tier 1 (SSD) ──evict──► tier 2 (remote) ──evict──► dropped
    get ◄── hit in tier i > 0: moved back up to tier 0 (which may push others down)

Room is made before a put: while the tier's used bytes + the value's footprint exceed capacity,
the victim chooser names a session and it moves one tier down (recursively). A value bigger than
a whole tier skips it. A value failing its checksum is dropped and counts as a miss.

Locking. The engine thread looks sessions up while the writer thread saves turns, the prefetch
thread moves sessions up and the API thread deletes them. An LMDB or Redis write of one session
takes 50-300 ms; a lookup of a DRAM-resident session must not wait for it. So there are two locks:

    _lock      (RLock) what lives in memory: the DRAM tier, the in-transit map, the chooser,
               counters and events. Held only for memory work: DRAM copies, index look-ups.
    _io_lock   (Lock) every write or delete in a slow tier (`in_memory = False`), one thread at
               a time. Taken before `_lock`, never while holding it.

Reads of a slow tier (get, prefetch) happen outside both locks and are validated afterwards: a
per-key generation, bumped whenever the key changes place or value, must be the one seen before
the read, else the read is retried.

In transit. A session on its way into a slow tier is parked in `_transit` (key -> _Transit):

    put that evicts v from DRAM    under _lock: v's value copied out of DRAM, DRAM freed,
                                   _transit[v] = value; the put lands in DRAM; lock released
                                   then, holding only _io_lock: v written to LMDB (making room
                                   there first, recursively); then under _lock: if _transit[v]
                                   is still that entry, v now lives in LMDB; else (re-put,
                                   deleted or read back up meanwhile) the LMDB copy is stale and
                                   is deleted, so it can never win.

Reads see transit values: `get` of an in-transit key is a hit served from memory and moves the
value back up to DRAM; the entry is replaced at once, so the finishing write finds itself stale.

Order of a demotion from a durable tier (LMDB -> Redis): the value is read from LMDB, written to
Redis, and only then deleted from LMDB; a crash, or a Redis write that raises, in between leaves
the session in LMDB (a failed write leaves it there for good and the room is not made).

Markers. A `_Transit` without a value is a marker: "every slow-tier copy of this key except the
one in tier `home` (None: all of them) is garbage". A put or promotion into DRAM, a delete, a
finished demotion leave one instead of deleting under `_lock`; reads never look past it. Whoever
holds `_io_lock` deletes the garbage and pops the marker (`_drain`, before releasing the lock,
and `delete` waits for it), so garbage never outlives the call that made it by more than one
in-flight write, and never becomes visible.

Who still waits: a call that parked victims (a put or promotion into a full DRAM) lands them
itself before it returns, so it waits for the I/O lock (a write in flight elsewhere); so does a
`delete` of a session with slow-tier copies. A call that only reads DRAM or transit values, or
puts into DRAM without evicting, never does. Under `_lock` a slow tier is only asked `contains`
(LMDB: a dict; Redis: one EXISTS, as before).

The chooser is told about keys as before: `touch` on put, hit and hinted prefetch, `forget` when a
key leaves the store (deleted, dropped); it is only called under `_lock`.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from chatstore.store.codec import CorruptValueError, FingerprintMismatch
from chatstore.store.events import EventLog, StoreCounters, StoreEvent, StoreStats
from chatstore.store.session_kv import SessionKey, SessionKV
from chatstore.store.tier import StorageTier, TierFull, TierOccupancy
from chatstore.store.victims import LruChooser, VictimChooser

log = logging.getLogger(__name__)

OPTIMISTIC_READS = 3  # reads of a slow tier outside the lock before one is done under it


@dataclass(eq=False)
class _Transit:
    """A session value on its way into a slow tier (value set), or a marker (value None)."""

    key: SessionKey
    value: SessionKV | None
    levels: range = range(0)  # tiers it may land in, tried in order
    source: int | None = None  # level of a durable copy of the same value (deleted once landed)
    kind: str = "demoted"  # the event its landing emits
    tier: str | None = None  # what tier_of reports while it is in transit
    restore: bool = False  # if no tier in `levels` takes it, it stays at `source` (promotions)
    home: int | None = None  # markers: the one slow tier whose copy is valid (None: none)
    landed: str | None = None  # where it ended up, set once it has been settled
    stuck: bool = False  # markers: deleting the garbage failed; retried at the next drain


@dataclass(frozen=True)
class _Found:
    """Where a key is, as reads see it: in DRAM, in transit, in a slow tier, or nowhere."""

    where: str  # "top" | "transit" | "tier" | "none"
    level: int | None = None
    entry: _Transit | None = None


_NONE = _Found("none")


@dataclass(frozen=True)
class _Done:
    """A read's answer, final."""

    result: object


@dataclass(frozen=True)
class _Read:
    """A value read from slow tier `level` outside the lock, when key's generation was gen."""

    key: SessionKey
    level: int
    gen: int
    value: SessionKV | None
    corrupt: bool


class TierHierarchy:
    def __init__(
        self,
        tiers: list[StorageTier],
        chooser: VictimChooser | None = None,
        events: EventLog | None = None,
    ) -> None:
        if not tiers:
            raise ValueError("a hierarchy needs at least one tier")
        if any(t.in_memory for t in tiers[1:]):
            raise ValueError("only the first tier may be an in-memory tier")
        self.tiers = tiers
        self.chooser = chooser or LruChooser()
        self.events = events or EventLog()
        self.counters = StoreCounters()
        self.device_occupancy: Callable[[], TierOccupancy] | None = None
        self._lock = threading.RLock()
        self._io_lock = threading.Lock()
        self._transit: dict[SessionKey, _Transit] = {}
        self._gen: dict[SessionKey, int] = {}  # key -> generation (see module doc)
        self._clock = itertools.count(1)
        # Levels of the slow tiers: where transit values land and garbage is deleted.
        self._first_slow = 1 if tiers[0].in_memory else 0
        self._slow = range(self._first_slow, len(tiers))

    # -- reads ------------------------------------------------------------------------------

    def tier_of(self, key: SessionKey) -> str | None:
        with self._lock:
            found = self._locate(key)
            if found.where == "top":
                return self.tiers[0].name
            if found.where == "transit":
                return found.entry.tier  # type: ignore[union-attr]
            if found.where == "tier":
                return self.tiers[found.level].name  # type: ignore[index]
            return None

    def get(self, key: SessionKey) -> SessionKV | None:
        """key's KV from the fastest tier holding it, moved up to tier 0; None on a miss."""
        parked: list[_Transit] = []
        try:
            return self._read_loop(key, self._get_start, self._get_finish, parked)
        finally:
            self._finish(parked)

    def prefetch(self, key: SessionKey, touch: bool = False) -> bool:
        """Move key up to tier 0 ahead of use (scheduler-aware fetch); True if it moved.

        touch: count it as used (an explicit hint), so the chooser does not send it back down
        before its turn comes. A chooser with `ranked_below(key, keys)` (PolicyChooser) vetoes a
        prefetch that would push out a session it values at least as much as key."""
        parked: list[_Transit] = []
        start = functools.partial(self._prefetch_start, hint=[True] if touch else [])
        try:
            moved = self._read_loop(key, start, self._prefetch_finish, parked)
        finally:
            self._finish(parked)
        if isinstance(moved, _Transit):
            return moved.landed == self.tiers[0].name
        return moved == self.tiers[0].name

    # -- writes -----------------------------------------------------------------------------

    def put(self, key: SessionKey, value: SessionKV) -> str | None:
        """Store value as key's KV (replacing any old one); the tier it landed in, or None.

        The old value is replaced, not removed first: in the tier the new one lands in, the
        tier's own put swaps them atomically (LMDB: one write transaction), and copies in other
        tiers go only after it landed. A crash mid-put leaves the old or the new value."""
        parked: list[_Transit] = []
        own: _Transit | None = None
        landed: str | None = None
        with self._lock:
            self.chooser.touch(key)
            self._bump(key)
            top = self.tiers[0]
            if top.in_memory and self._put_top(key, value, parked, "stored"):
                landed = top.name
            else:
                if top.in_memory:
                    top.delete(key)  # the old value; the new one is readable in transit
                own = _Transit(key, value, self._slow, kind="stored", tier=self._slow_name())
                self._set_entry(key, own)
                parked.append(own)
        self._finish(parked)
        return own.landed if own is not None else landed

    def delete(self, key: SessionKey) -> bool:
        """Remove key from every tier; True if it was stored. Returns once the slow-tier
        copies are gone (it may wait for a write in flight)."""
        with self._lock:
            found = self._locate(key).where != "none"
            top = self.tiers[0]
            if top.in_memory:
                top.delete(key)
            slow = key in self._transit or any(self.tiers[i].contains(key) for i in self._slow)
            if slow:
                self._set_entry(key, _Transit(key, None))
            self._gen.pop(key, None)
            self.chooser.forget(key)
            if found:
                self._emit("deleted", key)
        if slow:
            self._settle_now()  # the slow-tier copies go before this returns
        return found

    def clear(self) -> None:
        with self._lock:
            for tier in self.tiers:
                for key in tier.keys():  # noqa: SIM118 (a tier, not a dict)
                    self.chooser.forget(key)
                    if not tier.in_memory:
                        self._set_entry(key, _Transit(key, None))
                if tier.in_memory:
                    tier.clear()
            for key in list(self._transit):
                self.chooser.forget(key)
                self._set_entry(key, _Transit(key, None))
            self._gen.clear()
        self._settle_now()

    def demote_all(self, level: int = 0) -> None:
        """Move everything in tier `level` one tier down (graceful shutdown keeps DRAM on SSD)."""
        tier = self.tiers[level]
        with self._io():
            while True:
                parked: list[_Transit] = []
                with self._lock:
                    keys = [k for k in tier.keys() if k not in self._transit]  # noqa: SIM118
                    if not keys:
                        return
                    if tier.in_memory:
                        self._park(keys[0], parked)
                if not tier.in_memory and not self._demote_slow(level, keys[0]):
                    return  # a lower tier failed: what is left stays here
                for entry in parked:
                    self._land_safely(entry)

    def settle(self) -> None:
        """Finish deferred deletions of garbage copies now (waits for a write in flight)."""
        self._settle_now()

    # -- state ------------------------------------------------------------------------------

    @property
    def lock(self) -> threading.RLock:
        """The lock of in-memory state (for callers that combine several reads). Do not call
        put/get/delete while holding it: they take the I/O lock, which comes first."""
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

    def in_transit(self) -> int:
        """Keys in transit or with stale slow-tier copies still to delete (0 once every call
        has returned, unless deleting a stale copy failed)."""
        with self._lock:
            return len(self._transit)

    # -- where a key is (under _lock) -----------------------------------------------------

    def _locate(self, key: SessionKey) -> _Found:
        top = self.tiers[0]
        if top.in_memory and top.contains(key):
            return _Found("top", 0)
        entry = self._transit.get(key)
        if entry is not None:
            if entry.value is not None:
                return _Found("transit", entry=entry)
            if entry.home is None or not self.tiers[entry.home].contains(key):
                return _NONE
            return _Found("tier", entry.home)
        for level in self._slow:
            if self.tiers[level].contains(key):
                return _Found("tier", level)
        return _NONE

    def _bump(self, key: SessionKey) -> int:
        self._gen[key] = gen = next(self._clock)
        return gen

    def _gen_of(self, key: SessionKey) -> int:
        gen = self._gen.get(key)
        return gen if gen is not None else self._bump(key)

    def _set_entry(self, key: SessionKey, entry: _Transit) -> None:
        self._transit[key] = entry
        self._bump(key)

    def _current(self, entry: _Transit) -> bool:
        with self._lock:
            return self._transit.get(entry.key) is entry

    def _slow_name(self) -> str | None:
        return self.tiers[self._first_slow].name if self._slow else None

    # -- reading a slow tier outside the lock ------------------------------------------------

    def _read_loop(
        self,
        key: SessionKey,
        start: Callable[[SessionKey, list[_Transit]], _Done | tuple[int, int]],
        finish: Callable[[_Read, list[_Transit]], _Done | None],
        parked: list[_Transit],
    ) -> object:
        """start(key, parked), under _lock, answers at once (_Done) or names a slow tier to read
        and the key's generation; the read runs outside the lock, then finish(read, parked)
        under it answers (_Done) or asks for a retry (None: the key moved meanwhile). After
        OPTIMISTIC_READS retries (other threads kept moving the key) the read is done under
        the lock, so a busy key cannot starve its reader."""
        for attempt in itertools.count():
            with self._lock:
                step = start(key, parked)
                if isinstance(step, _Done):
                    return step.result
                level, gen = step
                if attempt >= OPTIMISTIC_READS:
                    done = finish(self._read(key, level, gen), parked)
                    if done is not None:
                        return done.result
                    continue
            read = self._read(key, level, gen)
            with self._lock:
                done = finish(read, parked)
            if done is not None:
                return done.result
        raise AssertionError("unreachable")

    def _read(self, key: SessionKey, level: int, gen: int) -> _Read:
        """Read key from slow tier `level`; a corrupt value has been dropped by the tier."""
        try:
            value, corrupt = self.tiers[level].get(key), False
        except (CorruptValueError, FingerprintMismatch):
            value, corrupt = None, True
        return _Read(key, level, gen, value, corrupt)

    def _still_valid(self, read: _Read) -> bool:
        """(under _lock) Whether a value read outside the lock is still the key's value: its
        generation did not move meanwhile. Counts a corrupt value."""
        if read.corrupt:
            tier = self.tiers[read.level]
            self.counters.tier(tier.name).corrupt += 1
            self._emit("corrupt", read.key, tier.name)
            self._bump(read.key)
            return False
        return read.value is not None and self._gen.get(read.key) == read.gen

    def _get_start(self, key: SessionKey, parked: list[_Transit]) -> _Done | tuple[int, int]:
        found = self._locate(key)
        if found.where == "top":
            top = self.tiers[0]
            value = top.get(key)
            assert value is not None
            self._hit(key, top.name, value)
            return _Done(value)
        if found.where == "transit":
            assert found.entry is not None
            return _Done(self._hit_in_transit(found.entry, parked))
        if found.where == "none":
            self.counters.misses += 1
            self._emit("miss", key)
            return _Done(None)
        assert found.level is not None
        return found.level, self._gen_of(key)

    def _get_finish(self, read: _Read, parked: list[_Transit]) -> _Done | None:
        if not self._still_valid(read):
            return None
        assert read.value is not None
        self._hit(read.key, self.tiers[read.level].name, read.value)
        self._move_up(read.level, read.key, read.value, "promoted", parked)
        return _Done(read.value)

    def count_pending_hit(self, key: SessionKey, value: SessionKV) -> None:
        """A lookup served a turn still in the write buffer: counted as a hit of the top tier,
        where that turn is about to land (hit rates by tier keep adding up to the total)."""
        with self._lock:
            self._hit(key, self.tiers[0].name, value)

    def _hit(self, key: SessionKey, tier: str, value: SessionKV) -> None:
        self.counters.tier(tier).hits += 1
        self._emit("hit", key, tier, value.nbytes)
        self.chooser.touch(key)

    def _hit_in_transit(self, entry: _Transit, parked: list[_Transit]) -> SessionKV:
        """A hit on a value on its way down: served from memory and put back into DRAM (the
        entry is replaced, so the write in flight finds itself stale). If DRAM cannot take it,
        the caller gets a copy: the value itself is still to be written."""
        key, value = entry.key, entry.value
        assert value is not None
        self._hit(key, entry.tier or self.tiers[0].name, value)
        if self.tiers[0].in_memory and self._put_top(key, value, parked, "promoted"):
            if entry.source is not None:
                self.counters.bytes_up += value.nbytes
            return value
        return SessionKV(list(value.token_ids), value.kv.clone())

    def _prefetch_start(
        self, key: SessionKey, parked: list[_Transit], hint: list[bool]
    ) -> _Done | tuple[int, int]:
        found = self._locate(key)
        if found.where != "tier" or found.level == 0:
            return _Done(None)  # at the top already, on its way, or not stored
        assert found.level is not None
        if hint:  # touch once, not on every retry
            self.chooser.touch(key)
            hint.clear()
        if not self._room_below(key, 1):  # cheap veto before reading it
            return _Done(None)
        return found.level, self._gen_of(key)

    def _prefetch_finish(self, read: _Read, parked: list[_Transit]) -> _Done | None:
        if not self._still_valid(read):
            return None
        assert read.value is not None
        if not self._room_below(read.key, self.tiers[0].footprint(read.value)):
            return _Done(None)
        self.counters.prefetches += 1
        return _Done(self._move_up(read.level, read.key, read.value, "prefetched", parked))

    # -- moving up (under _lock) ------------------------------------------------------------

    def _move_up(
        self, level: int, key: SessionKey, value: SessionKV, kind: str, parked: list[_Transit]
    ) -> str | _Transit:
        """key's value, read from slow tier `level`, moved to the top: into DRAM now, or (slow
        top, or DRAM refused it) into a faster slow tier by `_finish`. The tier name it is in,
        or the transit entry that will land it."""
        if self.tiers[0].in_memory and self._put_top(key, value, parked, kind):
            self.counters.bytes_up += value.nbytes
            return self.tiers[0].name
        levels = range(self._first_slow, level)
        if not levels:
            return self.tiers[level].name  # can never live higher up: leave it where it is
        entry = _Transit(
            key, value, levels, source=level, kind=kind, tier=self.tiers[level].name, restore=True
        )
        self._set_entry(key, entry)
        parked.append(entry)
        return entry

    def _put_top(
        self, key: SessionKey, value: SessionKV, parked: list[_Transit], kind: str
    ) -> bool:
        """value into the in-memory top tier, parking victims for `_finish`; False if it does
        not fit (victims parked so far stay parked, as a put that then goes lower)."""
        top = self.tiers[0]
        if top.footprint(value) > top.capacity or not self._make_room_top(key, value, parked):
            return False
        try:
            top.put(key, value)
        except TierFull:
            return False
        # Slow-tier copies (older values, or the one just read up) are garbage from now on.
        if key in self._transit or any(self.tiers[i].contains(key) for i in self._slow):
            self._set_entry(key, _Transit(key, None))
        self._bump(key)
        self._emit(kind, key, top.name, value.nbytes)
        return True

    def _make_room_top(self, key: SessionKey, value: SessionKV, parked: list[_Transit]) -> bool:
        top = self.tiers[0]
        need = top.footprint(value) - top.size_of(key)  # a value it replaces frees its room
        while top.used_bytes() + need > top.capacity:
            candidates = [k for k in top.keys() if k != key]  # noqa: SIM118
            victim = self.chooser.choose_victim(top.name, candidates)
            if victim is None:
                return False
            self._park(victim, parked)
        return True

    def _park(self, victim: SessionKey, parked: list[_Transit]) -> None:
        """Evict victim from the in-memory top: its value moves to `_transit` (still readable)
        and its room is free at once; `_finish` writes it to a slow tier."""
        top = self.tiers[0]
        value = top.get(victim)
        top.delete(victim)
        self._bump(victim)
        self.counters.tier(top.name).evictions += 1
        self._emit("evicted", victim, top.name)
        if value is None:
            self.chooser.forget(victim)
        elif not self._slow:
            self._dropped(victim, value.nbytes)
        else:
            entry = _Transit(victim, value, self._slow, kind="demoted", tier=top.name)
            self._set_entry(victim, entry)
            parked.append(entry)

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

    # -- slow-tier work (holding _io_lock, not _lock) -----------------------------------------

    @contextmanager
    def _io(self, blocking: bool = True) -> Iterator[bool]:
        """Hold the I/O lock; on the way out delete the garbage markers name (see `_release`)."""
        if self._lock._is_owned():  # type: ignore[attr-defined]
            if blocking:
                raise RuntimeError("TierHierarchy: slow-tier work requested while holding .lock")
            yield False
            return
        if not self._io_lock.acquire(blocking=blocking):
            yield False
            return
        try:
            yield True
        finally:
            self._release()

    def _release(self) -> None:
        """Drain garbage, release the I/O lock, and take it back if a marker arrived meanwhile
        whose maker could not take the lock (it relies on the holder): none is left behind."""
        while True:
            try:
                self._drain()
            finally:
                self._io_lock.release()
            with self._lock:
                waiting = any(e.value is None and not e.stuck for e in self._transit.values())
            if not waiting or not self._io_lock.acquire(blocking=False):
                return

    def _finish(self, parked: list[_Transit]) -> None:
        """After a call's memory work: land what it parked (waiting for the I/O lock), or just
        delete garbage if the I/O lock is free."""
        if not parked:
            with self._lock:
                if not any(e.value is None and not e.stuck for e in self._transit.values()):
                    return
            with self._io(blocking=False):
                return
        with self._io():
            for entry in parked:
                self._land_safely(entry)

    def _settle_now(self) -> None:
        with self._io():
            pass

    def _land_safely(self, entry: _Transit) -> str | None:
        try:
            return self._land(entry)
        except Exception:
            log.exception("moving %s between tiers failed", entry.key)
            try:
                return self._settle_unplaced(entry, failed=True)
            except Exception:
                log.exception("settling %s failed", entry.key)
                return None

    def _land(self, entry: _Transit) -> str | None:
        """Write entry's value into the first tier of entry.levels that takes it (making room
        there first), then settle the entry; the tier it is in afterwards, or None."""
        failed = False
        value = entry.value
        assert value is not None
        for level in entry.levels:
            tier = self.tiers[level]
            if tier.footprint(value) > tier.capacity:
                continue
            if not self._current(entry):
                return self._abandon(entry)
            if not self._make_room_slow(level, entry.key, value):
                continue
            if not self._current(entry):
                return self._abandon(entry)
            try:
                tier.put(entry.key, value)
            except TierFull:
                continue
            except Exception:
                log.exception("writing %s to the %s tier failed", entry.key, tier.name)
                with self._lock:
                    self.counters.tier(tier.name).errors += 1
                failed = True
                continue
            return self._settle_landed(entry, level)
        return self._settle_unplaced(entry, failed)

    def _make_room_slow(self, level: int, key: SessionKey, value: SessionKV) -> bool:
        tier = self.tiers[level]
        while True:
            self._drain()  # garbage first: deleting it may be all the room needed
            with self._lock:
                need = tier.footprint(value) - tier.size_of(key)
                if tier.used_bytes() + need <= tier.capacity:
                    return True
                candidates = [
                    k
                    for k in tier.keys()  # noqa: SIM118
                    if k != key and k not in self._transit
                ]
                victim = self.chooser.choose_victim(tier.name, candidates)
                if victim is None:
                    return False
                before = tier.used_bytes()
            if not self._demote_slow(level, victim):
                return False
            if tier.contains(victim) and tier.used_bytes() >= before:
                return False  # no progress (the victim stayed): do not spin

    def _demote_slow(self, level: int, victim: SessionKey) -> bool:
        """Move victim from slow tier `level` one tier down: written below first, deleted here
        after (a crash in between leaves it here). False if it stayed (a write failed)."""
        tier = self.tiers[level]
        with self._lock:
            if victim in self._transit or not tier.contains(victim):
                return True
            gen = self._gen_of(victim)
            if level + 1 >= len(self.tiers):  # falls off the last tier
                self._set_entry(victim, _Transit(victim, None))
                self.counters.tier(tier.name).evictions += 1
                self._emit("evicted", victim, tier.name)
                self._dropped(victim, tier.size_of(victim))
                last = True
            else:
                last = False
        if last:
            self._collect(victim)
            return True
        read = self._read(victim, level, gen)
        with self._lock:
            if not self._still_valid(read) or victim in self._transit:
                return True  # gone or changed meanwhile: the caller looks at the room again
            entry = _Transit(
                victim, read.value, range(level + 1, len(self.tiers)), source=level, tier=tier.name
            )
            self._set_entry(victim, entry)
        return self._land_safely(entry) != tier.name

    # -- settling an entry (holding _io_lock) -------------------------------------------------

    def _settle_landed(self, entry: _Transit, level: int) -> str | None:
        key, tier = entry.key, self.tiers[level]
        value = entry.value
        assert value is not None
        with self._lock:
            current = self._transit.get(key) is entry
            if current:
                # Every other slow-tier copy (the durable source, older values) is garbage now.
                self._set_entry(key, _Transit(key, None, home=level))
                self._landed_events(entry, tier.name, value)
        if not current:
            tier.delete(key)  # re-put, deleted or read back up meanwhile: this copy is stale
        self._collect(key)
        entry.landed = tier.name if current else None
        return entry.landed

    def _settle_unplaced(self, entry: _Transit, failed: bool) -> str | None:
        """No tier in entry.levels took it: dropped, or (promotion; a failed write of a value
        that has a durable copy) left where it was."""
        key = entry.key
        result: str | None = None
        with self._lock:
            if self._transit.get(key) is entry:
                if entry.source is not None and (entry.restore or failed):
                    self._set_entry(key, _Transit(key, None, home=entry.source))
                    result = self.tiers[entry.source].name
                else:
                    self._set_entry(key, _Transit(key, None))
                    if entry.source is not None:
                        source = self.tiers[entry.source].name
                        self.counters.tier(source).evictions += 1
                        self._emit("evicted", key, source)
                    self._dropped(key, entry.value.nbytes if entry.value is not None else 0)
        self._collect(key)
        entry.landed = result
        return result

    def _abandon(self, entry: _Transit) -> None:
        """entry was superseded before it was written anywhere: nothing of it to undo."""
        self._collect(entry.key)
        entry.landed = None

    def _landed_events(self, entry: _Transit, tier: str, value: SessionKV) -> None:
        if entry.kind == "demoted":
            if entry.source is not None:
                source = self.tiers[entry.source].name
                self.counters.tier(source).evictions += 1
                self._emit("evicted", entry.key, source)
            self.counters.bytes_down += value.nbytes
        elif entry.kind in ("promoted", "prefetched"):
            self.counters.bytes_up += value.nbytes
        self._emit(entry.kind, entry.key, tier, value.nbytes)

    def _dropped(self, key: SessionKey, nbytes: int) -> None:
        self.counters.dropped += 1
        self.chooser.forget(key)
        self._gen.pop(key, None)
        self._emit("dropped", key, None, nbytes)

    def _drain(self) -> None:
        with self._lock:
            keys = [k for k, e in self._transit.items() if e.value is None]
        for key in keys:
            self._collect(key)

    def _collect(self, key: SessionKey) -> None:
        """If key has a marker: delete its garbage copies, then drop the marker (unless it was
        replaced meanwhile: the new one is collected by a later drain)."""
        with self._lock:
            marker = self._transit.get(key)
            if marker is None or marker.value is not None:
                return
            doomed = [self.tiers[i] for i in self._slow if i != marker.home]
        try:
            for tier in doomed:
                if tier.contains(key):  # cheaper than a delete where it is absent (Redis)
                    tier.delete(key)
        except Exception:
            log.exception("deleting stale copies of %s failed; retried later", key)
            marker.stuck = True
            return
        with self._lock:
            if self._transit.get(key) is marker:
                del self._transit[key]

    def _emit(self, kind: str, key: SessionKey, tier: str | None = None, nbytes: int = 0) -> None:
        self.events.emit(StoreEvent(kind, key, tier, nbytes))  # type: ignore[arg-type]


def _copy_counters(c: StoreCounters) -> StoreCounters:
    from dataclasses import replace

    tiers = {name: replace(t) for name, t in c.tiers.items()}
    return replace(c, tiers=tiers)
