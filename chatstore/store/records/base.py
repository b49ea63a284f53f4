"""Durable session records: the `RecordStore` contract (the record and its errors: record.py).

A record is a session's tenant, messages, the token ids whose KV is saved (and their chunk
keys' digests), timestamps, retention and the version a turn appends on top of. The store and
the API share this one type. Backends: LMDB (lmdb.py, the embedded default, `sync=True`: a
record `put` survives a `kill -9`) and Redis (redis.py, durability is Redis's own persistence
setting). A record idle longer than its TTL reads as absent.

A write that cannot be made durable raises `RecordStoreFull` (the LMDB map or the disk is full)
or `RecordStoreUnavailable` (Redis down or too slow): the API then refuses to acknowledge the
turn instead of answering 200 for a record it does not have.

Encryption at rest: with a `sealer` every record is stored sealed under its tenant's key, its
storage name the associated data (sealing/sealer.py). A record that fails to open (a wrong or
shredded key, a changed byte, a value moved under another name) reads as absent and is counted
in `open_failures`: it is never served, and it never turns into an error. The store's
`RecordSealing` (record_sealing.py) does both, and re-seals values for key rotation.

Besides the sessions a backend keeps two more namespaces: the prefix index (prefix_index.py:
which session a client that resends its history continues) and the stored Responses
(responses.py).
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

from chatstore.store.records.prefix_index import PrefixMatch
from chatstore.store.records.record import ChainRecord, RecordConflict, SessionRecord
from chatstore.store.records.record_sealing import RecordSealing
from chatstore.store.records.responses import ResponseRecords
from chatstore.store.sealing import Sealer
from chatstore.store.sealing.legacy_v1 import LegacyOpener
from chatstore.store.session_kv import SessionKey


class _Absent(Exception):
    """patch(): no live record to change."""


Change = Callable[[SessionRecord | None], SessionRecord]


class RecordStore(ABC):
    """The records contract: reads, atomic read-modify-writes (create-if-absent, compare-and-
    set on the version, patch), listing, expiry, prefix matching and the Responses namespace.
    A backend implements storage (`put`, `delete`, `_load`, `_all`, `_update`, the index)."""

    responses: ResponseRecords

    def __init__(self, ttl_s: int = 0, sealer: Sealer | None = None) -> None:
        self.ttl_s = ttl_s  # the server's session TTL; a record's own ttl_s overrides it
        self.sealing = RecordSealing(sealer)

    # -- sealing (record_sealing.py) --------------------------------------------------------

    @property
    def sealer(self) -> Sealer | None:
        return self.sealing.sealer

    @sealer.setter
    def sealer(self, sealer: Sealer | None) -> None:
        self.sealing.sealer = sealer

    @property
    def open_failures(self) -> int:
        """Records that failed to open (read as absent)."""
        return self.sealing.open_failures

    @open_failures.setter
    def open_failures(self, count: int) -> None:
        self.sealing.open_failures = count

    def seal(self, tenant: str, name: bytes, raw: bytes) -> bytes:
        return self.sealing.seal(tenant, name, raw)

    def unseal(self, tenant: str, name: bytes, raw: bytes | None) -> bytes | None:
        """raw opened (None when absent or when it fails to open: counted, read as absent)."""
        return self.sealing.unseal(tenant, name, raw)

    def digest_key(self, tenant: str) -> bytes:
        """The key of tenant's prefix index hashes (RecordSealing.digest_key)."""
        return self.sealing.digest_key(tenant)

    def index_mark(self) -> bytes:
        """What a backend's "prefix index built" marker holds (RecordSealing.index_mark)."""
        return self.sealing.index_mark()

    def reseal(
        self,
        tenant: str,
        name: bytes,
        raw: bytes,
        adopt_clear: bool = False,
        legacy: LegacyOpener | None = None,
    ) -> bytes | None:
        """raw re-sealed under its tenant's current sealing key, or None: it needs nothing or
        does not open (RecordSealing.reseal: rotation, adopt_clear, legacy)."""
        return self.sealing.reseal(tenant, name, raw, adopt_clear, legacy)

    # -- expiry -----------------------------------------------------------------------------

    def ttl_of(self, record: SessionRecord) -> int:
        """The record's idle TTL in seconds (0: never expires)."""
        return record.ttl_s or self.ttl_s

    def expires_at(self, record: SessionRecord) -> float | None:
        ttl = self.ttl_of(record)
        return record.updated_at + ttl if ttl > 0 else None

    def expired(self, record: SessionRecord, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        deadline = self.expires_at(record)
        return deadline is not None and deadline < now

    def _expiry_s(self, record: SessionRecord) -> int | None:
        """Seconds a backend with its own expiry (Redis `ex=`) keeps the record; None: always."""
        deadline = self.expires_at(record)
        return None if deadline is None else max(1, math.ceil(deadline - time.time()))

    def _live(self, record: SessionRecord | None) -> SessionRecord | None:
        """record with its expiry filled in; None when absent or expired."""
        if record is None or self.expired(record):
            return None
        record.expires_at = self.expires_at(record)
        return record

    # -- reads and atomic writes ------------------------------------------------------------

    def get(self, key: SessionKey) -> SessionRecord | None:
        return self._live(self._load(key))

    def upsert(self, key: SessionKey, **changes: Any) -> SessionRecord:
        """Create or update a record's fields atomically (a concurrent writer's other fields are
        kept); `updated_at` moves to now."""
        return self._done(self._update(key, lambda r: self._changed(key, r, changes)))

    def record_chain(self, key: SessionKey, chain: ChainRecord) -> SessionRecord:
        """The session's KV chain, recorded alone (a commit the API does not record itself)."""
        return self.upsert(
            key, token_ids=chain.token_ids, chunks=chain.chunks, fingerprint=chain.fingerprint
        )

    def _changed(
        self, key: SessionKey, record: SessionRecord | None, changes: dict[str, Any]
    ) -> SessionRecord:
        if record is None or self.expired(record):
            record = SessionRecord(key.tenant, key.session_id)
        for name, value in changes.items():
            setattr(record, name, value)
        if "messages" in changes:
            record.version += 1
        record.updated_at = time.time()
        return record

    def patch(self, key: SessionKey, **changes: Any) -> SessionRecord | None:
        """Change fields of a live record atomically (retention, metadata); None when there is
        none. Neither `version` (the messages are untouched) nor `updated_at` (a setting is not
        activity) moves."""

        def patched(current: SessionRecord | None) -> SessionRecord:
            if current is None or self.expired(current):
                raise _Absent
            for name, value in changes.items():
                setattr(current, name, value)
            return current

        try:
            return self._done(self._update(key, patched))
        except _Absent:
            return None

    def create(self, record: SessionRecord) -> SessionRecord:
        """Write a new record (version 1); RecordConflict when a live one has its key."""

        def created(current: SessionRecord | None) -> SessionRecord:
            if current is not None and not self.expired(current):
                raise RecordConflict(f"session {record.session_id} already exists")
            record.version = (current.version if current is not None else 0) + 1
            return record

        return self._done(self._update(record.key, created))

    def append_turn(
        self,
        key: SessionKey,
        base_version: int,
        new_messages: list[dict[str, Any]],
        keep: int | None = None,
        chain: ChainRecord | None = None,
        **changes: Any,
    ) -> SessionRecord:
        """Append a turn's messages if the record is still at `base_version` (an absent one is
        at 0), atomically; RecordConflict otherwise. `keep`: the stored messages kept before the
        new ones (a client that resent an edited history); None keeps them all. `chain`: the
        turn's KV chain, recorded with them. `changes`: other fields set with it (kv_tokens,
        last_token)."""

        def appended(current: SessionRecord | None) -> SessionRecord:
            if current is not None and self.expired(current):
                current = None
            found = current.version if current is not None else 0
            if found != base_version:
                raise RecordConflict(
                    f"session {key.session_id} is at version {found}, not {base_version}"
                )
            record = current or SessionRecord(key.tenant, key.session_id)
            kept = record.messages if keep is None else record.messages[:keep]
            record.messages = [*kept, *new_messages]
            if chain is not None:
                chain.apply(record)
            for name, value in changes.items():
                setattr(record, name, value)
            record.version = found + 1
            record.updated_at = time.time()
            return record

        return self._done(self._update(key, appended))

    def _done(self, record: SessionRecord) -> SessionRecord:
        record.expires_at = self.expires_at(record)
        return record

    def list_sessions(self, tenant: str | None = None) -> list[SessionRecord]:
        return [
            r
            for r in self._all(tenant)
            if (tenant is None or r.tenant == tenant) and self._live(r) is not None
        ]

    def restore_sessions(self) -> list[SessionRecord]:
        """The live records a start needs: those with KV chunks or a retention of their own
        (LMDB reads them through an index; Redis lists them)."""
        return [r for r in self.list_sessions() if r.chunks or r.priority or r.ttl_s]

    def restore_batches(self, size: int) -> Iterator[list[SessionRecord]]:
        """restore_sessions in batches of about `size` (the store's background restore reads
        them so, never all at once where the backend can page)."""
        found = self.restore_sessions()
        for i in range(0, len(found), size):
            yield found[i : i + size]

    @abstractmethod
    def count_sessions(self, tenant: str) -> int:
        """The tenant's live sessions, as every replica sharing the store counts them (a
        counter or an index kept with the records, not a listing)."""

    def purge_expired(self, now: float | None = None) -> list[SessionKey]:
        """Delete the sessions (and stored Responses) idle past their TTL; the sessions' keys.
        Reads only the expiry index's due entries (by tenant and name digest: no session id
        is stored in the clear) and their records, never the live ones."""
        now = time.time() if now is None else now
        gone = []
        for tenant, digest in self._due(now):
            record = self._load_due(tenant, digest)
            if record is not None and not self.expired(record, now):
                self._drop_due(tenant, digest, record)  # an entry left behind: it is live
            elif record is not None:
                self.delete(record.key)
                gone.append(record.key)
            else:  # gone by itself (Redis expired it) or not opening: its entry goes
                self._drop_due(tenant, digest, None)
        self.responses.purge_expired(self.ttl_s, now)
        return gone

    @abstractmethod
    def _due(self, now: float) -> list[tuple[str, str]]:
        """(tenant, name digest) of the sessions whose expiry entry is before now (the index,
        not the records)."""

    @abstractmethod
    def _load_due(self, tenant: str, digest: str) -> SessionRecord | None: ...

    @abstractmethod
    def _drop_due(self, tenant: str, digest: str, record: SessionRecord | None) -> None:
        """Drop the session's due entries (left behind); record: live, its own entry is
        written."""

    def match_prefix(self, tenant: str, token_ids: list[int], fingerprint: str) -> str | None:
        """The tenant's live session a client that resent its history continues (made by the
        model `fingerprint`): the longest saved history that is a prefix of token_ids, else
        the longest common prefix; None when none shares a token. O(1) index reads per
        PREFIX_STEP tokens of token_ids, whatever the number of sessions (prefix_index.py)."""
        match = self._prefix_match(tenant, token_ids, fingerprint)
        return match.session_id if match is not None else None

    @abstractmethod
    def _prefix_match(
        self, tenant: str, token_ids: list[int], fingerprint: str
    ) -> PrefixMatch | None: ...

    # -- storage (a backend's) --------------------------------------------------------------

    @abstractmethod
    def put(self, record: SessionRecord) -> None: ...

    @abstractmethod
    def delete(self, key: SessionKey) -> bool: ...

    @abstractmethod
    def delete_tenant(self, tenant: str) -> int:
        """Delete every record of tenant by name (none is opened); how many."""

    @abstractmethod
    def reseal_all(
        self,
        after: bytes = b"",
        batch: int = 64,
        adopt_clear: bool = False,
        legacy: LegacyOpener | None = None,
    ) -> tuple[int, bytes | None]:
        """Re-seal up to `batch` records (sessions and Responses) after `after` (`reseal`;
        adopt_clear: encrypt-existing; legacy: migrate-v1): (how many were rewritten, the
        cursor to resume from; None when done)."""

    @abstractmethod
    def rebuild_indexes(self) -> None:
        """The prefix index and the sessions' counts and expiry entries built again from every
        record that opens (after migrate-v1: its records did not open when they were built)."""

    @abstractmethod
    def _load(self, key: SessionKey) -> SessionRecord | None: ...

    @abstractmethod
    def _all(self, tenant: str | None = None) -> list[SessionRecord]:
        """Every record (of `tenant` when given; a backend may return more)."""

    @abstractmethod
    def _update(self, key: SessionKey, change: Change) -> SessionRecord:
        """Read-modify-write, atomic; the prefix index follows the token ids."""

    def close(self) -> None:
        return None
