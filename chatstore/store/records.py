"""Durable session records: tenant, messages, the token ids whose KV is saved, timestamps.

Embedded default: LMDB with synchronous commits (`sync=True`), so once `put` returns the record
survives a `kill -9`. With a Redis URL configured the records live in Redis instead (durability is
then Redis's own persistence setting). A record idle longer than the TTL reads as absent.

A write that cannot be made durable raises `RecordStoreFull` (the LMDB map or the disk is full)
or `RecordStoreUnavailable` (Redis down or too slow): the API then refuses to acknowledge the
turn instead of answering 200 for a record it does not have. LMDB keys start with the tenant, so
listing one tenant's sessions reads only that tenant's records.

Encryption at rest: with a `sealer` every record is stored sealed under its tenant's key (a
stored Response's under the tenant it belongs to), its storage name the associated data
(sealing/sealer.py). A record that fails to open (a wrong or shredded key, a changed byte, a
value moved under another name) reads as absent and is counted in `open_failures`: it is
never served, and it never turns into an error. `delete_tenant` removes a tenant's records by
name, without opening them (what crypto-shredding purges).
"""

from __future__ import annotations

import array
import base64
import bisect
import json
import logging
import math
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from chatstore.store.keys import key_digest
from chatstore.store.sealing import RECORD_PURPOSE, OpenError, Sealer
from chatstore.store.session_kv import SessionKey

log = logging.getLogger(__name__)


@dataclass
class SessionRecord:
    tenant: str
    session_id: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # the history whose KV is saved
    chunks: list[str] = field(default_factory=list)  # its chunk keys' digests, in order
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    metadata: dict[str, Any] = field(default_factory=dict)  # the client's, from POST /v1/sessions
    # The model the token ids (and chunks) were made for: another model's ids are not reused.
    fingerprint: str = ""
    # Bumped by every write of the messages (not by the store's KV bookkeeping): a turn appends
    # only if the record is still at the version it read (append_turn).
    version: int = 0
    # Retention (retention.py): idle seconds before the session expires (0: the server's
    # session TTL) and its eviction priority (higher stays in the fast tiers longer).
    ttl_s: int = 0
    priority: int = 0

    @property
    def key(self) -> SessionKey:
        return SessionKey(self.tenant, self.session_id)

    def to_json(self) -> bytes:
        # Token ids as base64 int32: a long history's list costs a JSON round trip per turn
        # otherwise (~7 ms at 7.5K tokens), which made saving grow with the history.
        fields = asdict(self)
        ids = array.array("i", fields.pop("token_ids"))
        fields["token_ids_b64"] = base64.b64encode(ids.tobytes()).decode()
        return json.dumps(fields).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> SessionRecord:
        fields = json.loads(raw)
        packed = fields.pop("token_ids_b64", None)
        if packed is not None:
            ids = array.array("i")
            ids.frombytes(base64.b64decode(packed))
            fields["token_ids"] = ids.tolist()
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in fields.items() if k in known})


class RecordStoreError(Exception):
    """A record could not be written durably (or read); the caller must not acknowledge."""


class RecordStoreFull(RecordStoreError):
    """No room for the record: the LMDB map (records_map_bytes) or the disk is full."""


class RecordStoreUnavailable(RecordStoreError):
    """The records backend (Redis) is down or did not answer in time."""


class RecordConflict(RecordStoreError):
    """The record changed since the writer read it (another replica wrote the session)."""


class _Absent(Exception):
    """patch(): no live record to change."""


class RecordStore(ABC):
    def __init__(self, ttl_s: int = 0, sealer: Sealer | None = None) -> None:
        self.ttl_s = ttl_s  # the server's session TTL; a record's own ttl_s overrides it
        self.sealer = sealer
        self.open_failures = 0  # records that failed to open (read as absent)

    def _encode(self, tenant: str, name: bytes, record: SessionRecord) -> bytes:
        raw = record.to_json()
        if self.sealer is None:
            return raw
        return bytes(self.sealer.seal(RECORD_PURPOSE, tenant, name, raw))

    def _decode(self, tenant: str, name: bytes, raw: bytes | None) -> SessionRecord | None:
        """The record stored as raw under name (None when absent or when it fails to open)."""
        if raw is None:
            return None
        try:
            if self.sealer is not None:
                raw = self.sealer.open(RECORD_PURPOSE, tenant, name, raw)
            return SessionRecord.from_json(raw)
        except (OpenError, ValueError, TypeError) as exc:
            self.open_failures += 1
            log.warning("session record %r failed to open (%s): read as absent", name, exc)
            return None

    def reseal(self, tenant: str, name: bytes, raw: bytes) -> bytes | None:
        """raw re-sealed under the sealing key when it is under an older key or in the clear
        (key rotation); None when it needs nothing or opens under no key."""
        if self.sealer is None or not self.sealer.needs_reseal(raw):
            return None
        try:
            plain = self.sealer.open(RECORD_PURPOSE, tenant, name, raw)
        except OpenError:
            if not raw.startswith(b"{"):
                return None
            plain = raw  # written in the clear before encryption was on
        try:
            SessionRecord.from_json(plain)
        except (ValueError, TypeError):
            return None
        return bytes(self.sealer.seal(RECORD_PURPOSE, tenant, name, plain))

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

    def get(self, key: SessionKey) -> SessionRecord | None:
        record = self._load(key)
        if record is None or self.expired(record):
            return None
        return record

    def upsert(self, key: SessionKey, **changes: Any) -> SessionRecord:
        """Create or update a record's fields atomically (a concurrent writer's other fields are
        kept); `updated_at` moves to now."""
        return self._update(key, lambda r: self._changed(key, r, changes))

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
            return self._update(key, patched)
        except _Absent:
            return None

    def create(self, record: SessionRecord) -> SessionRecord:
        """Write a new record (version 1); RecordConflict when a live one has its key."""

        def created(current: SessionRecord | None) -> SessionRecord:
            if current is not None and not self.expired(current):
                raise RecordConflict(f"session {record.session_id} already exists")
            record.version = (current.version if current is not None else 0) + 1
            return record

        return self._update(record.key, created)

    def append_turn(
        self,
        key: SessionKey,
        base_version: int,
        new_messages: list[dict[str, Any]],
        keep: int | None = None,
        **changes: Any,
    ) -> SessionRecord:
        """Append a turn's messages if the record is still at `base_version` (an absent one is
        at 0), atomically; RecordConflict otherwise. `keep`: the stored messages kept before the
        new ones (a client that resent an edited history); None keeps them all."""

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
            for name, value in changes.items():
                setattr(record, name, value)
            record.version = found + 1
            record.updated_at = time.time()
            return record

        return self._update(key, appended)

    def _update(self, key: SessionKey, change: Any) -> SessionRecord:
        """Read-modify-write; backends make it atomic."""
        record = change(self._load(key))
        self.put(record)
        return record

    def list_sessions(self, tenant: str | None = None) -> list[SessionRecord]:
        return [
            r
            for r in self._all(tenant)
            if (tenant is None or r.tenant == tenant) and not self.expired(r)
        ]

    def count_sessions(self, tenant: str) -> int:
        return len(self.list_sessions(tenant))

    def purge_expired(self, now: float | None = None) -> list[SessionKey]:
        gone = [r.key for r in self._all() if self.expired(r, now)]
        for key in gone:
            self.delete(key)
        return gone

    @abstractmethod
    def put(self, record: SessionRecord) -> None: ...

    @abstractmethod
    def delete(self, key: SessionKey) -> bool: ...

    @abstractmethod
    def _load(self, key: SessionKey) -> SessionRecord | None: ...

    @abstractmethod
    def _all(self, tenant: str | None = None) -> list[SessionRecord]:
        """Every record (of `tenant` when given; a backend may return more)."""

    def close(self) -> None:
        return None


class LmdbRecordStore(RecordStore):
    """Records in one LMDB environment, keyed `t:<tenant>/<digest>` (one tenant = one key range).
    The directory is 0700 and its files 0600: they hold every tenant's chat history."""

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
        self._migrate()

    @staticmethod
    def _prefix(tenant: str) -> bytes:
        return f"t:{quote(tenant, safe='')}/".encode()

    def _name(self, key: SessionKey) -> bytes:
        return self._prefix(key.tenant) + key_digest(key).encode()

    def _migrate(self) -> None:
        """Records written before keys carried the tenant: re-key them once."""
        with self.env.begin() as txn:
            old = [(k, v) for k, v in txn.cursor() if not k.startswith(b"t:")]
        if not old:
            return
        with self.env.begin(write=True) as txn:
            for name, raw in old:
                record = SessionRecord.from_json(raw)  # written before sealing existed
                new_name = self._name(record.key)
                txn.put(new_name, self._encode(record.tenant, new_name, record))
                txn.delete(name)

    def used_bytes(self) -> int:
        stat = self.env.stat()
        pages = stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]
        return pages * stat["psize"]

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

    def put(self, record: SessionRecord) -> None:
        name = self._name(record.key)
        raw = self._encode(record.tenant, name, record)
        self._check_room(len(raw))
        self._write(lambda txn: txn.put(name, raw))

    def delete(self, key: SessionKey) -> bool:
        return bool(self._write(lambda txn: txn.delete(self._name(key))))

    def _update(self, key: SessionKey, change: Any) -> SessionRecord:
        name = self._name(key)
        done: list[SessionRecord] = []

        def update(txn: Any) -> None:  # LMDB serialises write transactions
            raw = txn.get(name)
            record = change(self._decode(key.tenant, name, raw))
            encoded = self._encode(key.tenant, name, record)
            self._check_room(len(encoded) - (len(raw) if raw is not None else 0))
            txn.put(name, encoded)
            done.append(record)

        self._write(update)
        return done[0]

    def _load(self, key: SessionKey) -> SessionRecord | None:
        name = self._name(key)
        with self.env.begin() as txn:
            raw = txn.get(name)
        return self._decode(key.tenant, name, raw)

    def _all(self, tenant: str | None = None) -> list[SessionRecord]:
        prefix = b"t:" if tenant is None else self._prefix(tenant)
        with self.env.begin() as txn:
            cursor = txn.cursor()
            if not cursor.set_range(prefix):
                return []
            found = []
            for name, raw in cursor:
                if not name.startswith(prefix):
                    break
                found.append((name, raw))
        # The tenant is in the name (quoted); opening happens outside the read transaction.
        records = [self._decode(self._tenant_of(n), n, raw) for n, raw in found]
        return [r for r in records if r is not None]

    @staticmethod
    def _tenant_of(name: bytes) -> str:
        return unquote(name[2:].decode().rsplit("/", 1)[0])

    def delete_tenant(self, tenant: str) -> int:
        """Delete every record of tenant by name (none is opened); how many."""
        prefix = self._prefix(tenant)

        def drop(txn: Any) -> int:
            cursor = txn.cursor()
            names = []
            if cursor.set_range(prefix):
                for name in cursor.iternext(values=False):
                    if not name.startswith(prefix):
                        break
                    names.append(bytes(name))
            for name in names:
                txn.delete(name)
            return len(names)

        return int(self._write(drop))

    def reseal_all(self, after: bytes = b"", batch: int = 64) -> tuple[int, bytes | None]:
        """Re-seal up to `batch` records whose names follow `after` (key rotation); (how many
        were rewritten, the last name looked at: the cursor to resume from; None when done)."""
        with self.env.begin() as txn:
            cursor = txn.cursor()
            todo: list[tuple[bytes, bytes]] = []
            if cursor.set_range(after or b"t:"):
                for name, raw in cursor:
                    if name == after:
                        continue
                    if not name.startswith(b"t:") or len(todo) >= batch:
                        break
                    todo.append((bytes(name), bytes(raw)))
        if not todo:
            return 0, None
        done = 0
        for name, raw in todo:
            sealed = self.reseal(self._tenant_of(name), name, raw)
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


class RedisRecordStore(RecordStore):
    PREFIX = "chatstore:rec:"

    def __init__(
        self,
        url_or_client: str | Any,
        ttl_s: int = 0,
        timeout_s: float = 0.25,
        breaker: Any = None,
        sealer: Sealer | None = None,
    ) -> None:
        """breaker: the KV tier's CircuitBreaker when both live in one Redis, so an outage
        costs a few timeouts in all, then record operations fail at once (503)."""
        from chatstore.store.tiers.redis import connect_redis, outage_errors

        super().__init__(ttl_s, sealer)
        self.breaker = breaker
        self._reseal_order: list[bytes] | None = None  # record names, while a rotation runs
        self._errors = outage_errors()
        if isinstance(url_or_client, str):
            self.client = connect_redis(url_or_client, timeout_s)
        else:
            self.client = url_or_client
        self._rename_legacy_records()

    def _name(self, key: SessionKey) -> str:
        # The hash tag puts a record and anything named after it (`<name>:…`) in one Redis
        # Cluster slot, so one transaction can cover them.
        return f"{self.PREFIX}{{{quote(key.tenant, safe='')}:{key_digest(key)}}}"

    def _rename_legacy_records(self) -> None:
        """Records named before the hash tag (`chatstore:rec:<tenant>:<digest>`, single-node
        Redis only) get their tagged name, once; a tagged record already there wins."""
        import logging

        def rename() -> int:
            done = 0
            for raw in self.client.scan_iter(match=f"{self.PREFIX}*", count=1000):
                old = raw.decode() if isinstance(raw, bytes) else raw
                rest = old[len(self.PREFIX) :]
                if rest.startswith("{"):
                    continue
                if not self.client.renamenx(old, f"{self.PREFIX}{{{rest}}}"):
                    self.client.delete(old)
                done += 1
            return done

        try:
            if done := self._call(rename):
                logging.getLogger(__name__).info("renamed %d session records (hash tags)", done)
        except RecordStoreUnavailable as exc:
            logging.getLogger(__name__).warning("session records: legacy names kept (%s)", exc)

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        breaker = self.breaker
        if breaker is not None and not breaker.allow():
            raise RecordStoreUnavailable("session records (Redis) unavailable: circuit open")
        try:
            out = fn(*args, **kwargs)
        except self._errors as exc:
            if breaker is not None:
                breaker.failure(exc)
            raise RecordStoreUnavailable(f"session records (Redis) unavailable: {exc}") from None
        except BaseException:
            if breaker is not None:
                breaker.success()  # Redis answered (an error reply is not an outage)
            raise
        if breaker is not None:
            breaker.success()
        return out

    def put(self, record: SessionRecord) -> None:
        name = self._name(record.key)
        raw = self._encode(record.tenant, name.encode(), record)
        self._call(self.client.set, name, raw, ex=self._expiry_s(record))

    def delete(self, key: SessionKey) -> bool:
        return bool(self._call(self.client.delete, self._name(key)))

    def get(self, key: SessionKey) -> SessionRecord | None:
        return self._call(super().get, key)

    def upsert(self, key: SessionKey, **changes: Any) -> SessionRecord:
        return self._call(super().upsert, key, **changes)

    def create(self, record: SessionRecord) -> SessionRecord:
        return self._call(super().create, record)

    def patch(self, key: SessionKey, **changes: Any) -> SessionRecord | None:
        return self._call(super().patch, key, **changes)

    def append_turn(
        self,
        key: SessionKey,
        base_version: int,
        new_messages: list[dict[str, Any]],
        keep: int | None = None,
        **changes: Any,
    ) -> SessionRecord:
        return self._call(super().append_turn, key, base_version, new_messages, keep, **changes)

    def list_sessions(self, tenant: str | None = None) -> list[SessionRecord]:
        return self._call(super().list_sessions, tenant)

    def _update(self, key: SessionKey, change: Any) -> SessionRecord:
        name = self._name(key)
        done: list[SessionRecord] = []

        def attempt(pipe: Any) -> None:  # retried by redis-py if `name` changes meanwhile
            raw = pipe.get(name)
            record = change(self._decode(key.tenant, name.encode(), raw))
            pipe.multi()
            pipe.set(
                name, self._encode(key.tenant, name.encode(), record), ex=self._expiry_s(record)
            )
            done[:] = [record]

        self.client.transaction(attempt, name)
        return done[0]

    def _load(self, key: SessionKey) -> SessionRecord | None:
        name = self._name(key)
        return self._decode(key.tenant, name.encode(), self.client.get(name))

    def _tenant_of(self, name: str) -> str:
        return unquote(name[len(self.PREFIX) + 1 :].rsplit(":", 1)[0])

    def _names(self, tenant: str | None) -> list[str]:
        # quote() leaves no glob character in a tenant (*, ?, [ are %-escaped; `{` is literal
        # in a Redis glob). Only names ending in the tag's `}` are records.
        tag = f"{{{quote(tenant, safe='')}:" if tenant else "{"
        return [
            name
            for raw in self.client.scan_iter(match=f"{self.PREFIX}{tag}*", count=1000)
            if (name := raw.decode() if isinstance(raw, bytes) else raw).endswith("}")
        ]

    def delete_tenant(self, tenant: str) -> int:
        """Delete every record of tenant by name (none is opened); how many."""

        def drop() -> int:
            names = self._names(tenant)
            for name in names:  # one by one: the names lie in many cluster slots
                self.client.delete(name)
            return len(names)

        return int(self._call(drop))

    def reseal_all(self, after: bytes = b"", batch: int = 64) -> tuple[int, bytes | None]:
        """Re-seal the records (key rotation), `batch` names after `after`, in name order (SCAN
        has no cursor that survives a restart); (rewritten, the cursor; None: done). The
        names are listed once per job (a first call, or one resuming), not per batch. A record
        changed meanwhile is read again (WATCH, as every update here)."""

        def run() -> tuple[int, bytes | None]:
            if not after or self._reseal_order is None:
                self._reseal_order = sorted(n.encode() for n in self._names(None))
            order = self._reseal_order
            names = order[bisect.bisect_right(order, after) :][:batch]
            done = sum(self._reseal_one(name.decode()) for name in names)
            if not names:
                self._reseal_order = None
            return done, names[-1] if names else None

        return self._call(run)

    def _reseal_one(self, name: str) -> bool:
        def attempt(pipe: Any) -> bool:  # retried by redis-py if `name` changes meanwhile
            raw = pipe.get(name)
            sealed = raw and self.reseal(self._tenant_of(name), name.encode(), raw)
            if not sealed:
                return False
            pipe.multi()
            pipe.set(name, sealed, keepttl=True)
            return True

        return bool(self.client.transaction(attempt, name, value_from_callable=True))

    def _all(self, tenant: str | None = None) -> list[SessionRecord]:
        names = self._names(tenant)
        # GETs in a pipeline, not one MGET: the names lie in many cluster slots.
        with self.client.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.get(name)
            raws = pipe.execute() if names else []
        records = [
            self._decode(self._tenant_of(name), name.encode(), raw)
            for name, raw in zip(names, raws, strict=True)
        ]
        return [r for r in records if r is not None]

    def close(self) -> None:
        self.client.close()
