"""A turn's commit: its chain indexed at once, its new chunks stored, the record written, the chunks
nobody holds any more deleted.

Order of a turn's save: the session's new chain is indexed at once (a lookup from now on sees
the new turn; its chunks are served from the write buffer until they land), the writer thread
then stores the new chunks, deletes the chunks nobody holds any more, and writes the record.
Every change to which chunks exist runs on the writer thread or under `mutate`, and re-checks
references when it runs: a chunk is stored only while some session holds it and deleted only
when none does, so no interleaving of turns, deletes and truncations leaks or loses one.

The record and the API's turn: a turn the API opened with a `TurnChain` on its handle
(opened_turn.py) is recorded by the API itself, in the one write that appends its messages: the
commit completes that future instead of writing the record, so a turn costs one record write and
one fsync, not two. Every other commit (the engine used without the API, a truncation) writes the
record here, and so does a commit whose turn the API gave up (aborted, failed) before or after it.

Locks: `lock` is the store's (the index, pending chunks); `mutate` (which chunks exist) is
taken before `lock`, never while holding it. The writer and the write-back hold `mutate` in
Linux's idle CPU class; whoever waits for it raises them meanwhile (cpu_priority.InheritingLock).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from chatstore.cpu_priority import InheritingLock
from chatstore.store.commit.persister import Persister
from chatstore.store.commit.shared_warmth import SharedWarmth
from chatstore.store.commit.write_buffer import WriteBuffer
from chatstore.store.opened_turn import TurnChain
from chatstore.store.port_values import ChunkBuilder, ChunkDelta, TurnPlan
from chatstore.store.records.base import RecordStore
from chatstore.store.records.record import ChainRecord
from chatstore.store.session_kv import ChunkKey, SessionKey, SessionKV
from chatstore.store.sessions.index import SessionChain, SessionIndex
from chatstore.store.sessions.versions import SessionVersions
from chatstore.store.settings import StoreSettings
from chatstore.store.tiers.chunk_tiers import ChunkTiers

log = logging.getLogger(__name__)

ChunkValue = SessionKV | ChunkDelta


class Memo:
    """build() run once, whichever thread asks first (the writer or a reader)."""

    def __init__(self, build: Callable[[], Mapping[ChunkKey, ChunkValue]]) -> None:
        self._build = build
        self._value: Mapping[ChunkKey, ChunkValue] | None = None
        self._lock = threading.Lock()

    def __call__(self) -> Mapping[ChunkKey, ChunkValue]:
        with self._lock:
            if self._value is None:
                self._value = self._build()
            return self._value


@dataclass(frozen=True)
class TurnWrite:
    """A turn as the writer thread commits it."""

    key: SessionKey
    chain: SessionChain
    new_chunks: list[ChunkKey]
    freed: list[ChunkKey]
    memo: Memo
    bases: list[ChunkKey] = field(default_factory=list)  # chunks its deltas build on
    recorded_by: TurnChain | None = None  # the API records the chain with its turn


@dataclass(frozen=True)
class ChainWrite:
    """A committed chain whose turn the API gave up after the commit: recorded by the writer
    thread while it is still the session's."""

    key: SessionKey
    chain: ChainRecord
    current: Callable[[], bool]


class TurnCommitted(NamedTuple):
    """One commit as it ended (commit listeners get it on the committing thread)."""

    key: SessionKey
    cpu_s: float  # the committing thread's CPU time (building and storing the chunks)
    bytes_written: int  # chunk bytes handed to the tiers
    background: bool  # on the writer thread (async_save)


CommitListener = Callable[[TurnCommitted], object]


class TurnCommitter:
    """Pending chunks (indexed, not stored yet) and the commits that store them."""

    def __init__(
        self,
        settings: StoreSettings,
        fingerprint: str,
        index: SessionIndex,
        tiers: ChunkTiers,
        records: RecordStore,
        lock: threading.RLock,
        versions: SessionVersions,
        touch: Callable[[SessionKey], None],
    ) -> None:
        self.settings, self.fingerprint = settings, fingerprint
        self.index, self.tiers, self.records = index, tiers, records
        self.lock, self.versions, self._touch = lock, versions, touch
        # held by the writer and the write-back in the idle CPU class: a waiter raises them
        self.mutate = InheritingLock()
        self.pending: dict[ChunkKey, Memo] = {}  # chunk -> the pending turn that builds it
        self.base_pins: dict[ChunkKey, int] = {}  # chunk -> pending turns building on it
        self.bytes_written = 0  # chunk bytes handed to the tiers (new chunks only)
        self.deferred: list[ChunkKey] | None = None  # deletes waiting for the index's restore
        self._listeners: list[CommitListener] = []
        self.writer = WriteBuffer(self._commit_queued, settings.write_buffer_bytes)
        self.persister: Persister | None = None
        slow = any(t.name in ("ssd", "remote") for t in tiers.tiers)
        persisting = settings.persist != "off" and slow and tiers.top is not None
        self.warmth = SharedWarmth(tiers, index, copy_shared=persisting)
        if persisting:
            # write_through copies on the writer thread; its persister only retries refusals.
            self.persister = Persister(
                self._persist_chunk,
                settings.persist_lag_s,
                before_copy=self.warmth.before_write_back,
            )

    def add_listener(self, listener: CommitListener) -> None:
        self._listeners.append(listener)

    def needed(self, chunk: ChunkKey) -> bool:
        """Held by a session, or the base a pending turn builds a chunk on (a turn may be
        submitted before the previous one, which stores that base, has committed)."""
        return self.index.referenced(chunk) or chunk in self.base_pins

    def has_chunk(self, key: ChunkKey) -> bool:
        return key in self.pending or self.tiers.contains(key)

    def write_turn(
        self,
        key: SessionKey,
        chain: SessionChain,
        plan: TurnPlan | None,
        build: ChunkBuilder,
        nbytes: int,
        background: bool,
        opened_at: float | None = None,
        recorded_by: TurnChain | None = None,
    ) -> None:
        """Index `chain` as key's history now (its new chunks readable from the write buffer)
        and commit the turn: on the writer thread when `background`, else here. recorded_by:
        the turn's future the commit completes instead of writing the record."""
        memo = Memo(lambda: {k: self._in_storage_dtype(v) for k, v in build().items()})
        new = list(plan.new_chunks) if plan is not None else []
        bases = [base for base, _ in plan.bases.values()] if plan is not None else []
        with self.lock:
            drop = self.versions.deleted_since(key, opened_at)
            if not drop:
                for chunk in new:
                    self.pending[chunk] = memo
                for base in bases:  # kept until this turn's chunks are built on it
                    self.base_pins[base] = self.base_pins.get(base, 0) + 1
                freed = self.index.set(key, chain)
                self._touch(key)
        if drop:
            log.info("dropped the save of a turn begun before %s was deleted", key)
            if recorded_by is not None:
                recorded_by.complete(None)
            build()  # it releases what the turn's rows hold (the layer saver's arena)
            return
        write = TurnWrite(key, chain, new, freed, memo, bases, recorded_by)
        if background:
            self.writer.submit(key, lambda: write, nbytes)
        else:
            self.commit(write, background=False)
        self.versions.bump(key)

    def _in_storage_dtype(self, value: ChunkValue) -> ChunkValue:
        dtype = self.settings.storage_dtype
        if isinstance(value, ChunkDelta):
            return ChunkDelta(value.base, value.keep, value.rows.to(dtype))
        return value.to(dtype)

    def _commit_queued(self, key: Hashable, write: object) -> None:
        if isinstance(write, ChainWrite):
            if write.current():
                self.records.record_chain(write.key, write.chain)
            return
        assert isinstance(write, TurnWrite)
        self.commit(write, background=True)

    def record_given_up(
        self, key: SessionKey, given_up: tuple[ChainRecord, Callable[[], bool]]
    ) -> None:
        """A chain committed for a turn the API then gave up: recorded on the writer thread
        (the caller is the event loop; a record write may wait on a disk or Redis)."""
        chain, current = given_up
        try:
            self.writer.submit(key, lambda: ChainWrite(key, chain, current), 0)
        except RuntimeError:  # closing: the record keeps its previous chain (a cache)
            log.info("the store is closing: %s's last chain is not recorded", key)

    def commit(self, write: TurnWrite, background: bool) -> None:
        t0, written = time.thread_time(), self.bytes_written
        try:
            self._commit(write)
            # The chunks the turn reused stay warm in Redis (shared_warmth.py), off the
            # `mutate` lock: a Redis round trip must not hold other commits.
            new = set(write.new_chunks)
            self.warmth.reused([c for c in write.chain.chunks if c not in new])
        finally:
            if write.recorded_by is not None:
                write.recorded_by.complete(None)  # failed before its record: nothing to take
            done = TurnCommitted(
                write.key, time.thread_time() - t0, self.bytes_written - written, background
            )
            for listener in self._listeners:
                listener(done)

    def _commit(self, write: TurnWrite) -> None:
        """New chunks in, then the record, then the chunks nobody holds out. A crash between
        any two leaves the old or the new record with every chunk it lists (or, after a
        write_back crash, its leading chunks), plus orphans the next start deletes."""
        with self.mutate.held_by(self.writer.priority):
            try:
                values = write.memo() if write.new_chunks else {}
                for chunk in write.new_chunks:
                    value = values.get(chunk)
                    if value is not None and self.needed(chunk):
                        self._store(chunk, value)
            finally:
                self._unpend(write)
            if self.index.get(write.key) is write.chain:  # the record after its chunks
                self._record(write)
            self.delete_unneeded(write.freed)

    # -- the record (see the module's doc) ------------------------------------------------------

    def chain_record(self, chain: SessionChain) -> ChainRecord:
        return ChainRecord(
            list(chain.token_ids), [c.digest for c in chain.chunks], self.fingerprint
        )

    def _record(self, write: TurnWrite) -> None:
        """The turn's chain into its session's record: by the API with the turn's messages
        when it records the turn and has not given it up, else here."""
        record = self.chain_record(write.chain)
        key, chain = write.key, write.chain
        api = write.recorded_by
        if api is None or not api.complete(record, lambda: self.index.get(key) is chain):
            self.records.record_chain(write.key, record)

    def _store(self, chunk: ChunkKey, value: ChunkValue) -> None:
        if isinstance(value, ChunkDelta):
            # The base is the session's old tail: when nobody else holds it and no other
            # pending turn builds on it, DRAM extends its blocks in place.
            base = value.base
            free = not self.index.referenced(base) and self.base_pins.get(base) == 1
            landed, written = self.tiers.put_extension(
                chunk, value.base, value.keep, value.rows, may_take_base=free
            )
        else:
            landed, written = self.tiers.put(chunk, value), value.nbytes
        if landed is not None:
            self.bytes_written += written
            self._persist_later(chunk)

    def _unpend(self, write: TurnWrite) -> None:
        with self.lock:
            for chunk in write.new_chunks:
                if self.pending.get(chunk) is write.memo:
                    del self.pending[chunk]
            for base in write.bases:
                left = self.base_pins.pop(base, 1) - 1
                if left:
                    self.base_pins[base] = left

    def delete_unneeded(self, chunks: list[ChunkKey]) -> None:
        """Under `mutate`: delete those of chunks no session and no pending turn holds. While
        the index is still being restored (sessions/restore.py) a chunk's references are not
        all known yet: the deletes wait for its end (`end_deferral`)."""
        if self.deferred is not None:
            self.deferred.extend(chunks)
            return
        for chunk in chunks:
            if not self.needed(chunk) and chunk not in self.pending:
                self.tiers.delete(chunk)

    def end_deferral(self) -> None:
        """Under `mutate`: the index is whole; the deletes that waited for it run."""
        deferred, self.deferred = self.deferred or [], None
        self.delete_unneeded(list(dict.fromkeys(deferred)))

    def free(self, chunks: list[ChunkKey]) -> None:
        with self.mutate:
            self.delete_unneeded(chunks)

    # -- write-back ----------------------------------------------------------------------------

    def _persist_later(self, chunk: ChunkKey) -> None:
        persister = self.persister
        if self.settings.persist != "write_through":
            if persister is not None:
                persister.add(chunk)
        elif persister is not None and persister.backing_off():
            persister.retry(chunk)  # the tier refused the last copies: no attempt until due
        elif not self._copy_down(chunk) and persister is not None:
            persister.retry(chunk)

    def _persist_chunk(self, chunk: ChunkKey) -> bool:
        """Write-back (the persister's thread): see _copy_down. False: try again later."""
        priority = self.persister.priority if self.persister is not None else None
        with self.mutate.held_by(priority):
            return not self.index.referenced(chunk) or self._copy_down(chunk)

    def _copy_down(self, chunk: ChunkKey) -> bool:
        """The chunk's copy on SSD (warm restart) and, with Redis, in Redis too, where another
        replica finds it when a session moves there. False when the chunk is still only in
        DRAM because the first slow tier did not take it (its map or disk is full): it stays
        there, served from there, and the persister tries again with a backoff."""
        copied = self.tiers.persist(chunk)
        self.tiers.share(chunk)
        top = self.tiers.top
        return copied or top is None or self.tiers.where(chunk) != top.name

    def flush(self, timeout: float | None = None) -> bool:
        """Pending writes land, then every stored chunk due for write-back reaches LMDB."""
        ok = self.writer.flush(timeout)
        return (self.persister.flush(timeout) if self.persister is not None else True) and ok
