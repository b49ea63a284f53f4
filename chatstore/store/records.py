"""Durable session records: tenant, messages, the token ids whose KV is saved, timestamps.

Embedded default: LMDB with synchronous commits (`sync=True`), so once `put` returns the record
survives a `kill -9`. With a Redis URL configured the records live in Redis instead (durability is
then Redis's own persistence setting). A record idle longer than the TTL reads as absent.
"""

from __future__ import annotations

import array
import base64
import json
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from chatstore.store.keys import key_digest
from chatstore.store.session_kv import SessionKey


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
        return cls(**fields)


class RecordStore(ABC):
    def __init__(self, ttl_s: int = 0) -> None:
        self.ttl_s = ttl_s

    def expired(self, record: SessionRecord, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        return self.ttl_s > 0 and record.updated_at + self.ttl_s < now

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
        record.updated_at = time.time()
        return record

    def _update(self, key: SessionKey, change: Any) -> SessionRecord:
        """Read-modify-write; backends make it atomic."""
        record = change(self._load(key))
        self.put(record)
        return record

    def list_sessions(self, tenant: str | None = None) -> list[SessionRecord]:
        return [
            r for r in self._all() if (tenant is None or r.tenant == tenant) and not self.expired(r)
        ]

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
    def _all(self) -> list[SessionRecord]: ...

    def close(self) -> None:
        return None


class LmdbRecordStore(RecordStore):
    def __init__(self, path: str | Path, ttl_s: int = 0, map_size: int = 1 << 30) -> None:
        import lmdb

        super().__init__(ttl_s)
        Path(path).mkdir(parents=True, exist_ok=True)
        self.env = lmdb.open(str(path), map_size=map_size, sync=True, metasync=True)

    def put(self, record: SessionRecord) -> None:
        with self.env.begin(write=True) as txn:
            txn.put(key_digest(record.key).encode(), record.to_json())

    def delete(self, key: SessionKey) -> bool:
        with self.env.begin(write=True) as txn:
            return txn.delete(key_digest(key).encode())

    def _update(self, key: SessionKey, change: Any) -> SessionRecord:
        name = key_digest(key).encode()
        with self.env.begin(write=True) as txn:  # LMDB serialises write transactions
            raw = txn.get(name)
            record = change(SessionRecord.from_json(raw) if raw is not None else None)
            txn.put(name, record.to_json())
        return record

    def _load(self, key: SessionKey) -> SessionRecord | None:
        with self.env.begin() as txn:
            raw = txn.get(key_digest(key).encode())
        return SessionRecord.from_json(raw) if raw is not None else None

    def _all(self) -> list[SessionRecord]:
        with self.env.begin() as txn:
            return [SessionRecord.from_json(raw) for _, raw in txn.cursor()]

    def close(self) -> None:
        self.env.close()


class RedisRecordStore(RecordStore):
    PREFIX = "chatstore:rec:"

    def __init__(self, url_or_client: str | Any, ttl_s: int = 0) -> None:
        import redis

        super().__init__(ttl_s)
        is_url = isinstance(url_or_client, str)
        self.client = redis.Redis.from_url(url_or_client) if is_url else url_or_client

    def _name(self, key: SessionKey) -> str:
        return f"{self.PREFIX}{quote(key.tenant, safe='')}:{key_digest(key)}"

    def put(self, record: SessionRecord) -> None:
        self.client.set(self._name(record.key), record.to_json(), ex=self.ttl_s or None)

    def delete(self, key: SessionKey) -> bool:
        return bool(self.client.delete(self._name(key)))

    def _update(self, key: SessionKey, change: Any) -> SessionRecord:
        name = self._name(key)
        done: list[SessionRecord] = []

        def attempt(pipe: Any) -> None:  # retried by redis-py if `name` changes meanwhile
            raw = pipe.get(name)
            record = change(SessionRecord.from_json(raw) if raw is not None else None)
            pipe.multi()
            pipe.set(name, record.to_json(), ex=self.ttl_s or None)
            done[:] = [record]

        self.client.transaction(attempt, name)
        return done[0]

    def _load(self, key: SessionKey) -> SessionRecord | None:
        raw = self.client.get(self._name(key))
        return SessionRecord.from_json(raw) if raw is not None else None

    def _all(self) -> list[SessionRecord]:
        names = list(self.client.scan_iter(match=f"{self.PREFIX}*", count=1000))
        raws = self.client.mget(names) if names else []
        return [SessionRecord.from_json(raw) for raw in raws if raw is not None]

    def close(self) -> None:
        self.client.close()
