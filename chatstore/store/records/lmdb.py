"""Session records in one LMDB environment (the embedded default), synchronous commits.

    t:<tenant>/<digest>   a session's record header (one tenant = one key range), and
    u:<tenant>/<digest>/  its log of turns (lmdb_log.py): a write appends, it never rewrites
    r:<tenant>/<digest>   a stored Response (responses.py)
    p:<tenant>/<hash>     a prefix index entry (prefix_index.py, lmdb_index.py), written in the
                          same transaction as the record whose token ids it follows
    m:<name>              markers of one-time migrations (lmdb_migrations.py)
    c:, x:                the per-tenant session counts and the expiry index (lmdb_facts.py)

The directory is 0700 and its files 0600: they hold every tenant's chat history.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from chatstore.store.record_keys import key_digest
from chatstore.store.records import ballast, lmdb_facts, lmdb_log, lmdb_migrations
from chatstore.store.records.base import Change, RecordStore
from chatstore.store.records.lmdb_facts import key_range as _range
from chatstore.store.records.lmdb_facts import tenant_of as _tenant_of
from chatstore.store.records.lmdb_index import INDEX, LmdbPrefixIndex
from chatstore.store.records.lmdb_log import SESSIONS
from chatstore.store.records.lmdb_responses import LmdbResponses
from chatstore.store.records.prefix_index import PrefixMatch, saved
from chatstore.store.records.record import RecordStoreFull, RecordStoreUnavailable, SessionRecord
from chatstore.store.sealing import Sealer
from chatstore.store.sealing.legacy_v1 import LegacyOpener
from chatstore.store.session_kv import SessionKey

if TYPE_CHECKING:
    from lmdb import Transaction

log = logging.getLogger(__name__)

T = TypeVar("T")

# The floor of the room kept for deletes: 64 pages of 4 KiB. A full 1 MiB map with a 16-page
# room stuck on its second delete (tests/store/test_reliability.py).
DELETE_ROOM = 256 << 10


class _DiskFull(RecordStoreFull):
    """The disk, not the map, is full: the ballast can make room."""


class LmdbRecordStore(RecordStore):
    def __init__(
        self,
        path: str | Path,
        ttl_s: int = 0,
        map_size: int = 1 << 30,
        sealer: Sealer | None = None,
    ) -> None:
        import lmdb

        from chatstore.store.tiers.lmdb import open_private

        super().__init__(ttl_s, sealer)
        self._lmdb = lmdb
        self.path = Path(path)
        self.env = open_private(self.path, map_size=map_size, sync=True, metasync=True)
        self.map_size = map_size
        # Deletes need free pages too (copy-on-write): writes stop this short of the map, so
        # that a full store can still delete sessions and recover. LMDB reuses the pages a
        # commit frees only two commits later (the previous snapshot stays whole), so deletes
        # in a row live on this room alone: each needs its own copied pages (a few leaves, a
        # branch, the free list's) while the previous delete's, record's included, are held.
        self._headroom = min(max(map_size // 16, DELETE_ROOM), 8 << 20)
        self.responses = LmdbResponses(self)
        self.bytes_put = 0  # names and values of the session records written (headers, logs)
        self.index = LmdbPrefixIndex(self.env, self.sealing, self._load_live)
        self._log_cache = lmdb_log.LogCache()  # assembled lists: O(new) reads per turn
        lmdb_migrations.migrate(self)
        ballast.keep(self.path)

    @staticmethod
    def _prefix(tenant: str, space: bytes = SESSIONS) -> bytes:
        return lmdb_facts.tenant_prefix(tenant, space)

    def _name(self, key: SessionKey) -> bytes:
        return self._prefix(key.tenant) + key_digest(key).encode()

    def rebuild_indexes(self) -> None:
        self.index.build(self._all())
        lmdb_migrations.build_facts(self)

    def _state(self, raw: bytes | None, record: SessionRecord | None) -> lmdb_facts.State:
        """What the facts know of a stored value (lmdb_facts.State), read before a change,
        which may edit the record in place."""
        if record is None:
            return raw is not None, None
        return self.expires_at(record), lmdb_facts.restored(record)

    def _facts(
        self,
        txn: Transaction[bytes],
        key: SessionKey,
        was: lmdb_facts.State,
        now: SessionRecord | None,
    ) -> None:
        """The tenant's count, the session's expiry entry and its start-up entry follow it
        from `was` (_state) to `now` (None: deleted)."""
        new = (False, False) if now is None else (self.expires_at(now), lmdb_facts.restored(now))
        lmdb_facts.moved(txn, key.tenant, key.session_id, key_digest(key), was, new)

    # -- room and errors --------------------------------------------------------------------

    def used_bytes(self) -> int:
        stat = self.env.stat()
        pages = stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]
        return int(pages * stat["psize"])

    def _check_room(self, nbytes: int) -> None:
        if self.used_bytes() + 2 * nbytes + self._headroom > self.map_size:
            raise RecordStoreFull(
                f"session records store is full ({self.map_size} bytes, records_map_bytes); "
                "delete sessions or raise the limit"
            )

    def _write(self, fn: Callable[[Transaction[bytes]], T]) -> T:
        try:
            with self.env.begin(write=True) as txn:
                return fn(txn)
        except self._lmdb.MapFullError:
            raise RecordStoreFull(
                f"session records store is full ({self.map_size} bytes, records_map_bytes)"
            ) from None
        except (OSError, self._lmdb.Error) as exc:
            if self._disk_full(exc):
                raise _DiskFull(f"disk full writing session records: {exc}") from None
            raise RecordStoreUnavailable(f"writing session records failed: {exc}") from None

    def _disk_full(self, exc: Exception) -> bool:
        """A full disk, by the KV tier's test, with twice the records' headroom as the floor."""
        from chatstore.store.tiers.lmdb import DISK_ROOM_MIN, is_disk_full

        return is_disk_full(exc, self.path, max(2 * self._headroom, DISK_ROOM_MIN))

    # -- sessions ---------------------------------------------------------------------------

    def put(self, record: SessionRecord) -> None:
        self._update(record.key, lambda _: record)

    def delete(self, key: SessionKey) -> bool:
        name = self._name(key)

        self._log_cache.drop(name)

        def drop(txn: Transaction[bytes]) -> bool:
            raw = txn.get(name)
            old, _ = self._read(txn, key.tenant, name, raw)
            self.index.move(txn, key, saved(old), None)
            self._facts(txn, key, self._state(raw, old), None)
            for entry, _ in _range(txn, lmdb_log.entry_prefix(name)):
                txn.delete(entry)
            return bool(txn.delete(name))

        try:
            deleted = bool(self._write(drop))
        except _DiskFull:
            if not ballast.drop(self.path):
                raise
            deleted = bool(self._write(drop))
        ballast.keep(self.path)
        return deleted

    def _update(self, key: SessionKey, change: Change) -> SessionRecord:
        name = self._name(key)
        done: list[SessionRecord] = []

        def update(txn: Transaction[bytes]) -> None:  # LMDB serialises write transactions
            raw = txn.get(name)
            old, entries = self._read(txn, key.tenant, name, raw)
            was, state = saved(old), self._state(raw, old)
            lists = lmdb_log.lists_of(old) if old is not None and entries is not None else None
            record = change(old)
            put, header, count = lmdb_log.write(
                self.sealing, txn, name, record, lists, entries, self._check_room
            )
            self.bytes_put += put
            self.index.move(txn, key, was, saved(record))
            self._facts(txn, key, state, record)
            done.append(record)
            written.append((header, count))

        written: list[tuple[bytes, int]] = []
        self._write(update)
        # Committed: the new header's bytes now stand for these lists (had the write failed,
        # the old header, and its cached lists, would still be what is stored).
        self._log_cache.put(name, written[0][0], written[0][1], done[0])
        return done[0]

    def _read(
        self,
        txn: Transaction[bytes],
        tenant: str,
        name: bytes,
        raw: bytes | None,
        cache: bool = True,
    ) -> lmdb_log.Opened:
        """The record stored as raw under name and its log's entry count (lmdb_log.open_record;
        cache: keep its lists, not for reads over many records)."""
        return lmdb_log.open_record(self.sealing, self._log_cache, txn, tenant, name, raw, cache)

    def _load(self, key: SessionKey) -> SessionRecord | None:
        name = self._name(key)
        with self.env.begin() as txn:
            return self._read(txn, key.tenant, name, txn.get(name))[0]

    def _all(self, tenant: str | None = None) -> list[SessionRecord]:
        prefix = SESSIONS if tenant is None else self._prefix(tenant)
        with self.env.begin() as txn:
            # The tenant is in the name (quoted).
            records = [
                self._read(txn, _tenant_of(n), n, raw, cache=False)[0]
                for n, raw in _range(txn, prefix)
            ]
        return [r for r in records if r is not None]

    def delete_tenant(self, tenant: str) -> int:
        """Delete every session record of tenant (and its index) by name, none opened."""

        def drop(txn: Transaction[bytes]) -> int:
            names = [n for n, _ in _range(txn, self._prefix(tenant))]
            others = [
                *_range(txn, self._prefix(tenant, INDEX)),
                *_range(txn, self._prefix(tenant, lmdb_log.LOG)),
            ]
            for name in [*names, *(n for n, _ in others)]:
                txn.delete(name)
            lmdb_facts.drop_tenant(txn, tenant)
            return len(names)

        self._log_cache.drop()
        return int(self._write(drop))

    # -- counts and expiry (lmdb_facts.py) ---------------------------------------------------

    def count_sessions(self, tenant: str) -> int:
        """The tenant's live sessions: its counter less its entries already due."""
        now = time.time()
        with self.env.begin() as txn:
            return max(0, lmdb_facts.count_of(txn, tenant) - lmdb_facts.due_count(txn, tenant, now))

    def restore_sessions(self) -> list[SessionRecord]:
        """The records the start needs (with KV chunks, or retention of their own): read
        through their index (lmdb_facts.py), not every record."""
        return [r for batch in self.restore_batches(1024) for r in batch]

    def restore_batches(self, size: int) -> Iterator[list[SessionRecord]]:
        """The start's names first (one read of the index), then their records `size` at a
        time, each batch in a read transaction of its own."""
        with self.env.begin() as txn:
            names = [(t, self._prefix(t) + d) for t, d in lmdb_facts.restore_entries(txn)]
        for i in range(0, len(names), size):
            with self.env.begin() as txn:
                found = [
                    self._read(txn, t, n, txn.get(n), cache=False)[0]
                    for t, n in names[i : i + size]
                ]
            yield [r for r in found if r is not None and self._live(r) is not None]

    def _due(self, now: float) -> list[tuple[str, str]]:
        with self.env.begin() as txn:
            return [
                (tenant, digest)
                for tenant in lmdb_facts.tenants(txn)
                for _, digest in lmdb_facts.due(txn, tenant, now)
            ]

    def _load_due(self, tenant: str, digest: str) -> SessionRecord | None:
        return self._by_digest(tenant, digest)

    def _by_digest(self, tenant: str, digest: str) -> SessionRecord | None:
        name = self._prefix(tenant) + digest.encode()
        with self.env.begin() as txn:
            return self._read(txn, tenant, name, txn.get(name))[0]

    def _load_live(self, tenant: str, digest: str) -> SessionRecord | None:
        """The live record of tenant's name digest (a prefix index candidate's)."""
        return self._live(self._by_digest(tenant, digest))

    def _drop_due(self, tenant: str, digest: str, record: SessionRecord | None) -> None:
        """Due entries that outlived their record's change (it failed to open then), or
        their record (None): they go; a live record gets its own entry back."""

        def drop(txn: Transaction[bytes]) -> None:
            for name, d in list(lmdb_facts.due(txn, tenant, time.time())):
                if d == digest:
                    txn.delete(name)
            if record is not None:
                txn.put(lmdb_facts.entry_name(tenant, self.expires_at(record), digest), b"")

        self._write(drop)

    # -- the prefix index (lmdb_index.py) ----------------------------------------------------

    def _prefix_match(
        self, tenant: str, token_ids: list[int], fingerprint: str
    ) -> PrefixMatch | None:
        return self.index.match(tenant, token_ids, fingerprint)

    # -- key rotation -----------------------------------------------------------------------

    def reseal_all(
        self,
        after: bytes = b"",
        batch: int = 64,
        adopt_clear: bool = False,
        legacy: LegacyOpener | None = None,
    ) -> tuple[int, bytes | None]:
        """Re-seal up to `batch` records (Responses, then sessions' headers and log entries)
        whose names follow `after`: (how many were rewritten, the cursor to resume from; None
        when done). lmdb_migrations.reseal_batch."""
        return lmdb_migrations.reseal_batch(self, after, batch, adopt_clear, legacy)

    def close(self) -> None:
        self.env.close()
