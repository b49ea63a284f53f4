"""At start: the index rebuilt from the session records that list KV chunks (or a retention of
their own: records.restore_batches, read through the records' index, not a listing of every
record), and the chunks on local tiers that no record lists (a crash between a commit's chunks
and its record) deleted.

With many stored sessions that read is the bulk of a start (100,000 sessions: seconds), so it
runs on a thread of its own (`chatstore-restore`) and the store serves at once:

    a turn opens a session the restore has not reached   its record is read then (`ensure`)
    a chunk loses its last known holder                  not deleted yet: another session not
                                                         restored yet may list it; the delete
                                                         waits for the end (`end_deferral`)
    a session deleted meanwhile                          its tombstone keeps the restore from
                                                         bringing it back
    the end                                              under the committer's `mutate`: the
                                                         waiting deletes, then the orphan sweep

Restored chains keep their token ids as 32-bit arrays (SessionChain.of_record): the index of
100,000 idle sessions is what a server holds in memory for them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from chatstore.store.chunks.keys import ChunkHasher
from chatstore.store.commit.turn_commit import TurnCommitter
from chatstore.store.records.base import RecordStore
from chatstore.store.records.record import RecordStoreUnavailable, SessionRecord
from chatstore.store.session_kv import ChunkKey, SessionKey
from chatstore.store.sessions.index import SessionChain
from chatstore.store.sessions.versions import SessionVersions
from chatstore.store.tiers.base import StorageTier

log = logging.getLogger(__name__)

BATCH = 512  # records read (and indexed under the store's lock) at a time


class IndexRestore:
    def __init__(
        self,
        committer: TurnCommitter,
        hasher: ChunkHasher,
        versions: SessionVersions,
        slow_tiers: list[StorageTier],
        retain: Callable[[SessionRecord], None],
        needed: Callable[[ChunkKey], bool],
        on_done: Callable[[], None] = lambda: None,
    ) -> None:
        self.committer, self.hasher, self.versions = committer, hasher, versions
        self.records: RecordStore = committer.records
        self.index, self.lock = committer.index, committer.lock
        self.fingerprint = committer.fingerprint
        self.slow_tiers, self.retain, self.on_done = slow_tiers, retain, on_done
        self.needed = needed  # a session, a pending turn or an opened turn holds the chunk
        self._done = threading.Event()
        self._started_at = time.monotonic()
        self.restored = 0  # sessions indexed by the restore (not by `ensure`)
        self.seconds = 0.0  # how long it took
        self._thread: threading.Thread | None = None

    def start(self, background: bool) -> None:
        """Restore now (background False), or on the restore thread."""
        with self.committer.mutate:
            self.committer.deferred = []
        if not background:
            self._run()
            return
        self._thread = threading.Thread(target=self._run, name="chatstore-restore", daemon=True)
        self._thread.start()

    @property
    def restoring(self) -> bool:
        return not self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Until the index is whole; False on timeout."""
        return self._done.wait(timeout)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def ensure(self, key: SessionKey) -> None:
        """The session's chain from its record now, if the restore has not indexed it yet
        (a turn opening it, or the engine finding it, before the restore got there)."""
        if not self.restoring:
            return
        with self.lock:
            if self.index.get(key) is not None:
                return
        try:
            record = self.records.get(key)
        except RecordStoreUnavailable as exc:
            log.debug("could not read %s's record: %s", key, exc)
            return
        if record is not None:
            self.retain(record)
            self._index([record])

    # -- the restore thread ------------------------------------------------------------------

    def _run(self) -> None:
        t0, complete = time.perf_counter(), False
        unopened = self.records.open_failures
        try:
            for batch in self.records.restore_batches(BATCH):
                for record in batch:
                    self.retain(record)
                self.restored += self._index(batch)
            # Records that did not open (another master key, a wrong secret) may hold the
            # local chunks: no sweep then, a value that does not open is never a delete.
            complete = self.records.open_failures == unopened
            if not complete:
                log.warning(
                    "%d session records did not open at start: no stored chunk is deleted as "
                    "unreferenced", self.records.open_failures - unopened,
                )  # fmt: skip
        except RecordStoreUnavailable as exc:
            # Redis out of reach at start (down, or refusing us: a TLS certificate that does
            # not verify, a wrong password). Serve from the local tiers; sessions are found in
            # the records when Redis is back. No orphan sweep: with no records read, every
            # local chunk would look unreferenced.
            log.warning("session records unreachable at start (%s): index starts empty", exc)
        except Exception:
            log.exception("restoring the session index failed: it holds what was read")
        finally:
            self._finish(sweep=complete)
            self.seconds = time.perf_counter() - t0
            log.info("session index restored: %d sessions in %.2f s", self.restored, self.seconds)

    def _chain(self, record: SessionRecord) -> SessionChain | None:
        chain = SessionChain.of_record(record, self.hasher, self.fingerprint)
        if chain is None and record.chunks and record.fingerprint != self.fingerprint:
            # Another model's ids (the API hides them: the next turn re-renders the
            # messages); its chunks are orphans, deleted at the end.
            log.info("session %s was saved by another model: its KV is not reused", record.key)
        return chain

    def _index(self, records: list[SessionRecord]) -> int:
        """Index the records' chains, except sessions the index already knows (a turn or
        `ensure` was first: theirs is newer) or deleted since the start; how many."""
        chains = [(r.key, c) for r in records if (c := self._chain(r)) is not None]
        added = 0
        with self.lock:
            for key, chain in chains:
                if self.index.get(key) is None and not self.versions.deleted_since(
                    key, self._started_at
                ):
                    self.index.set(key, chain)
                    added += 1
        return added

    def _finish(self, sweep: bool) -> None:
        """The index is whole (or as whole as it gets): deletes that waited run, orphans go."""
        committer = self.committer
        with committer.mutate:
            committer.end_deferral()
            self._done.set()
            orphans = self._sweep() if sweep else 0
        if orphans:
            log.info("deleted %d stored chunks no session references", orphans)
        self.on_done()

    def _sweep(self) -> int:
        """Under `mutate`: local slow-tier chunks nothing holds (`needed`, `pending`)."""
        orphans = 0
        for tier in self.slow_tiers:
            if tier.name == "remote":
                continue  # shared with other replicas: their chunks expire by TTL
            for key in list(tier.keys()):
                if not self.needed(key) and key not in self.committer.pending:
                    tier.delete(key)
                    orphans += 1
        return orphans
