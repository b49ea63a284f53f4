"""Session records in one LMDB environment (the embedded default), synchronous commits.

    t:<tenant>/<digest>   a session's record header (one tenant = one key range), and
    u:<tenant>/<digest>/  its log of turns (lmdb_log.py): a write appends, it never rewrites
    r:<tenant>/<digest>   a stored Response (responses.py)
    p:<tenant>/<hash>     a prefix index entry (prefix_index.py), written in the same
                          transaction as the record whose token ids it follows
    m:<name>              markers of one-time migrations
    c:, x:                the per-tenant session counts and the expiry index (lmdb_facts.py)

The directory is 0700 and its files 0600: they hold every tenant's chat history.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

from chatstore.store.keys import key_digest
from chatstore.store.records import ballast, lmdb_facts, lmdb_log, prefix_index
from chatstore.store.records.base import (
    Change,
    RecordStore,
)
from chatstore.store.records.lmdb_facts import key_range as _range
from chatstore.store.records.lmdb_facts import tenant_of as _tenant_of
from chatstore.store.records.lmdb_responses import LmdbResponses
from chatstore.store.records.prefix_index import PrefixEntry, PrefixMatch
from chatstore.store.records.record import RecordStoreFull, RecordStoreUnavailable, SessionRecord
from chatstore.store.sealing import Sealer
from chatstore.store.sealing.legacy_v1 import LegacyOpener, warn_if_legacy
from chatstore.store.session_kv import SessionKey

log = logging.getLogger(__name__)

SESSIONS, RESPONSES, INDEX = b"t:", b"r:", b"p:"
INDEX_BUILT = b"m:prefix-index"
LEGACY_SAMPLE = 16  # records a start looks at for version-1 values (a hint, not a scan)


Saved = tuple[tuple[int, ...], str]  # a record's saved token ids and fingerprint


def _saved(record: SessionRecord | None) -> Saved | None:
    return None if record is None else (tuple(record.token_ids), record.fingerprint)


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
        # that a full store can still delete sessions and recover.
        self._headroom = min(map_size // 16, 8 << 20)
        self.responses = LmdbResponses(self)
        self.bytes_put = 0  # names and values of the session records written (headers, logs)
        self._hash_memo = prefix_index.HashMemo()  # O(new) prefix index updates per turn
        self._log_cache = lmdb_log.LogCache()  # assembled lists: O(new) reads per turn
        self._migrate()
        ballast.keep(self.path)

    @staticmethod
    def _prefix(tenant: str, space: bytes = SESSIONS) -> bytes:
        return space + f"{quote(tenant, safe='')}/".encode()

    def _name(self, key: SessionKey) -> bytes:
        return self._prefix(key.tenant) + key_digest(key).encode()

    def _migrate(self) -> None:
        """Records written before keys carried the tenant: re-key them once. Records written
        before the prefix index: index them once."""
        with self.env.begin() as txn:
            old = []  # their names are hex digests: they sort before every `x:` name here
            for name, raw in txn.cursor():
                if bytes(name) >= INDEX_BUILT[:2]:
                    break
                if b":" not in bytes(name)[:2]:
                    old.append((bytes(name), bytes(raw)))
            indexed = txn.get(INDEX_BUILT) == self.index_mark()
            facts_ttl = lmdb_facts.ttl_marker(txn)
        if old and self.sealer is not None:
            # Clear values written before sealing existed: a migration never seals a value
            # it did not write (a planted one would become authentic). Left where they are.
            log.warning(
                "%s: %d records in an old clear layout are not read with encryption on: "
                "start once with encrypt_at_rest = false to migrate them, then run "
                "`chatstore admin encrypt-existing`",
                self.path, len(old),
            )  # fmt: skip
        elif old:
            with self.env.begin(write=True) as txn:
                for name, raw in old:
                    record = SessionRecord.from_json(raw)  # the clear layout before tenants
                    new_name = self._name(record.key)
                    txn.put(new_name, self._encode(record.tenant, new_name, record))
                    txn.delete(name)
        if not indexed:  # never, or hashed otherwise (before keyed hashes): built anew
            self._build_index()
        if facts_ttl != self.ttl_s:
            self._build_facts()
        if self.sealer is not None:
            warn_if_legacy(str(self.path), self._first_values(SESSIONS, LEGACY_SAMPLE))

    def _first_values(self, prefix: bytes, count: int) -> list[bytes]:
        """Up to `count` values whose names start with prefix (not the whole range)."""
        found: list[bytes] = []
        with self.env.begin() as txn:
            cursor = txn.cursor()
            if cursor.set_range(prefix):
                for name, raw in cursor:
                    if not name.startswith(prefix) or len(found) >= count:
                        break
                    found.append(bytes(raw))
        return found

    def _build_index(self) -> None:
        """The prefix index from every record that opens, its old entries dropped."""
        records = self._all()
        with self.env.begin(write=True) as txn:
            old_entries = txn.cursor()
            if old_entries.set_range(INDEX):
                while bytes(old_entries.key())[:2] == INDEX and old_entries.delete():
                    pass
            for record in records:
                self._index(txn, record.key, None, _saved(record))
            txn.put(INDEX_BUILT, self.index_mark())

    def rebuild_indexes(self) -> None:
        self._build_index()
        self._build_facts()

    def _build_facts(self) -> None:
        """The counts and the expiry index from every record: once for the records written
        before them, and again when the server's TTL changed (the deadlines move)."""
        records = self._all()
        with self.env.begin(write=True) as txn:
            for tenant in lmdb_facts.tenants(txn):
                lmdb_facts.drop_tenant(txn, tenant)
            for record in records:
                self._facts(txn, record.key, (False, False), record)
            lmdb_facts.set_ttl_marker(txn, self.ttl_s)

    def _state(self, raw: Any, record: SessionRecord | None) -> lmdb_facts.State:
        """What the facts know of a stored value (lmdb_facts.State), read before a change,
        which may edit the record in place."""
        if record is None:
            return raw is not None, None
        return self.expires_at(record), lmdb_facts.restored(record)

    def _facts(
        self, txn: Any, key: SessionKey, was: lmdb_facts.State, now: SessionRecord | None
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

    def _write(self, fn: Any) -> Any:
        try:
            with self.env.begin(write=True) as txn:
                return fn(txn)
        except self._lmdb.MapFullError:
            raise RecordStoreFull(
                f"session records store is full ({self.map_size} bytes, records_map_bytes)"
            ) from None
        except (OSError, self._lmdb.Error) as exc:
            if self._disk_full(exc):
                raise RecordStoreFull(f"disk full writing session records: {exc}") from None
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

        def drop(txn: Any) -> bool:
            raw = txn.get(name)
            old, _ = self._read(txn, key.tenant, name, raw)
            self._index(txn, key, _saved(old), None)
            self._facts(txn, key, self._state(raw, old), None)
            for entry, _ in _range(txn, lmdb_log.entry_prefix(name)):
                txn.delete(entry)
            return bool(txn.delete(name))

        try:
            deleted = bool(self._write(drop))
        except RecordStoreFull:
            if not ballast.drop(self.path):
                raise
            deleted = bool(self._write(drop))
        ballast.keep(self.path)
        return deleted

    def _update(self, key: SessionKey, change: Change) -> SessionRecord:
        name = self._name(key)
        done: list[SessionRecord] = []

        def update(txn: Any) -> None:  # LMDB serialises write transactions
            raw = txn.get(name)
            old, entries = self._read(txn, key.tenant, name, raw)
            was, state = _saved(old), self._state(raw, old)
            lists = lmdb_log.lists_of(old) if old is not None and entries is not None else None
            record = change(old)
            header, count = self._append(txn, name, record, lists, entries)
            self._index(txn, key, was, _saved(record))
            self._facts(txn, key, state, record)
            done.append(record)
            written.append((header, count))

        written: list[tuple[bytes, int]] = []
        self._write(update)
        # Committed: the new header's bytes now stand for these lists (had the write failed,
        # the old header, and its cached lists, would still be what is stored).
        self._log_cache.put(name, written[0][0], written[0][1], done[0])
        return done[0]

    def _append(
        self,
        txn: Any,
        name: bytes,
        record: SessionRecord,
        lists: dict[str, list[Any]] | None,
        entries: int | None,
    ) -> tuple[bytes, int]:
        """The header, and one log entry of what the change added (lists: the record's lists
        before it; None, or a full log: a new base, the old entries dropped); the header's
        stored bytes and the log's entry count."""
        tenant = record.tenant
        if lists is None or entries is None or entries >= lmdb_log.MAX_ENTRIES:
            for old_entry, _ in _range(txn, lmdb_log.entry_prefix(name)):
                txn.delete(old_entry)
            lists, entries = None, 0
        entry = lmdb_log.entry_json(lists, record)
        values = []
        if entry is not None:
            entry_name = lmdb_log.entry_name(name, entries)
            values.append((entry_name, self.seal(tenant, entry_name, entry)))
            entries += 1
        values.append((name, self.seal(tenant, name, lmdb_log.header_json(record, entries))))
        self._check_room(sum(len(v) for _, v in values))
        for value_name, value in values:
            txn.put(value_name, value)
        self.bytes_put += sum(len(n) + len(v) for n, v in values)
        return bytes(values[-1][1]), entries

    def _read(
        self, txn: Any, tenant: str, name: bytes, raw: Any, cache: bool = True
    ) -> tuple[SessionRecord | None, int | None]:
        """The record stored as raw under name, assembled from its header and log, and how
        many entries its log has (None: a whole record of the older layout, or none).
        cache: keep its lists (LogCache); not for reads over many records (a start's)."""
        plain = self.unseal(tenant, name, None if raw is None else bytes(raw))
        if plain is None:
            return None, None
        try:
            entries = lmdb_log.entries_of(plain)
            record = SessionRecord.from_json(plain)
            if entries is None:
                return record, None
            if self._log_cache.get(name, bytes(raw), record) == entries:
                return record, entries
            found = _range(txn, lmdb_log.entry_prefix(name))
            logged = [self.unseal(tenant, n, v) for n, v in found]
            if len(logged) != entries or any(p is None for p in logged):
                raise ValueError(f"its log has {len(logged)} entries, not {entries}")
            record = lmdb_log.assemble(record, [p for p in logged if p is not None])
            if cache:
                self._log_cache.put(name, bytes(raw), entries, record)
            return record, entries
        except (ValueError, TypeError, KeyError) as exc:
            self.open_failures += 1
            log.warning("session record %r failed to open (%s): read as absent", name, exc)
            return None, None

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

        def drop(txn: Any) -> int:
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
        name = self._prefix(tenant) + digest.encode()
        with self.env.begin() as txn:
            return self._read(txn, tenant, name, txn.get(name))[0]

    def _drop_due(self, tenant: str, digest: str, record: SessionRecord | None) -> None:
        """Due entries that outlived their record's change (it failed to open then), or
        their record (None): they go; a live record gets its own entry back."""

        def drop(txn: Any) -> None:
            for name, d in list(lmdb_facts.due(txn, tenant, time.time())):
                if d == digest:
                    txn.delete(name)
            if record is not None:
                txn.put(lmdb_facts.entry_name(tenant, self.expires_at(record), digest), b"")

        self._write(drop)

    # -- the prefix index -------------------------------------------------------------------

    def _index(self, txn: Any, key: SessionKey, was: Saved | None, now: Saved | None) -> None:
        """Move the session's index entries from what it registered with the saved ids and
        fingerprint `was` to what it does with `now` (only the entries that differ)."""
        if was == now:
            return
        digest = key_digest(key)
        memo = self._hash_memo
        hkey = self.digest_key(key.tenant)
        old = memo.registration(digest, key.tenant, was[1], was[0], hkey) if was else {}
        new = memo.registration(digest, key.tenant, now[1], now[0], hkey) if now else {}
        base = self._prefix(key.tenant, INDEX)
        for entry_key in prefix_index.changed_keys(old, new):
            name = base + entry_key.encode()
            entry = PrefixEntry.from_bytes(txn.get(name))
            entry = prefix_index.apply(entry, digest, entry_key, new)
            if entry.empty():
                txn.delete(name)
            else:
                txn.put(name, entry.to_bytes())

    def _prefix_match(
        self, tenant: str, token_ids: list[int], fingerprint: str
    ) -> PrefixMatch | None:
        base = self._prefix(tenant, INDEX)

        def read(keys: list[str]) -> list[bytes | None]:
            with self.env.begin() as txn:
                return [txn.get(base + k.encode()) for k in keys]

        def load(digest: str) -> tuple[str, list[int], str] | None:
            name = self._prefix(tenant) + digest.encode()
            with self.env.begin() as txn:
                record = self._live(self._read(txn, tenant, name, txn.get(name))[0])
            if record is None:
                return None
            return record.session_id, record.token_ids, record.fingerprint

        key = self.digest_key(tenant)
        return prefix_index.best_match(tenant, fingerprint, token_ids, read, load, key)

    # -- key rotation -----------------------------------------------------------------------

    def reseal_all(
        self,
        after: bytes = b"",
        batch: int = 64,
        adopt_clear: bool = False,
        legacy: LegacyOpener | None = None,
    ) -> tuple[int, bytes | None]:
        """Re-seal up to `batch` records (Responses, then sessions' headers and log entries)
        whose names follow `after` (key rotation, encrypt-existing, migrate-v1: `reseal`);
        (how many were rewritten, the last name looked at: the cursor to resume from; None
        when done)."""
        with self.env.begin() as txn:
            cursor = txn.cursor()
            todo: list[tuple[bytes, bytes]] = []
            if cursor.set_range(after or RESPONSES):
                for name, raw in cursor:
                    if name == after:
                        continue
                    if bytes(name)[:2] not in (RESPONSES, SESSIONS, lmdb_log.LOG):
                        break
                    if len(todo) >= batch:
                        break
                    todo.append((bytes(name), bytes(raw)))
        if not todo:
            return 0, None
        done = 0
        for name, raw in todo:
            sealed = self.reseal(_tenant_of(name), name, raw, adopt_clear, legacy)
            if sealed is None:
                continue

            def swap(
                txn: Any, name: bytes = name, raw: bytes = raw, sealed: bytes = sealed
            ) -> bool:
                return txn.get(name) == raw and txn.put(name, sealed)  # unchanged meanwhile

            done += bool(self._write(swap))
        return done, todo[-1][0]

    def close(self) -> None:
        self.env.close()
