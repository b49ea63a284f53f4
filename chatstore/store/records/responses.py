"""Stored Responses (OpenAI's Responses API): their own record type and namespace.

A `ResponseRecord` is named by its tenant and response id in a namespace of its own (LMDB
keys `r:<tenant>/<digest>`, Redis `chatstore:resp:{<tenant>:<digest>}`), sealed at rest under
its tenant's key like a session record, and expires with the server's session TTL like a
session. Each holds its whole conversation (no instructions), so continuing from any response
reads one record, whatever happened to its session since.

Before this namespace a response was a session record of the tenant "\\x00responses:<tenant>"
(messages: the conversation; metadata: the response JSON and its session id). Those still load:
a read that misses here looks there, and moves the one it finds into this namespace (written
here, then deleted there); those never read expire with their TTL as before.
"""

from __future__ import annotations

import contextlib
import json
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Protocol

from chatstore.store.records.record import SessionRecord
from chatstore.store.session_kv import SessionKey

# The tenant the records of a tenant's responses were kept under before (a NUL: no configured
# tenant can hold one, so no tenant could read them as its sessions).
LEGACY_NAMESPACE = "\x00responses:"


@dataclass
class ResponseRecord:
    tenant: str
    response_id: str
    body_json: str  # the response object as GET returns it
    session_id: str  # the session whose record and KV hold this conversation
    items: list[dict[str, str]] = field(default_factory=list)  # the conversation, with the reply
    created_at: float = field(default_factory=time.time)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> ResponseRecord:
        fields = json.loads(raw)
        return cls(**{k: v for k, v in fields.items() if k in cls.__dataclass_fields__})


class ResponseExists(Exception):
    """create(): a response with this id is already stored (never overwritten)."""


class SealedRecords(Protocol):
    """What the Responses namespace uses of the record store it lives in (base.RecordStore):
    its sealing, TTL, failure count, and its sessions for the legacy layout."""

    ttl_s: int
    open_failures: int

    def seal(self, tenant: str, name: bytes, raw: bytes) -> bytes: ...

    def unseal(self, tenant: str, name: bytes, stored: bytes | None) -> bytes | None: ...

    def get(self, key: SessionKey) -> SessionRecord | None: ...

    def delete(self, key: SessionKey) -> bool: ...

    def delete_tenant(self, tenant: str) -> int: ...


class ResponseRecords(ABC):
    """The Responses namespace of a record store (its sealing, TTL and error mapping)."""

    def __init__(self, records: SealedRecords) -> None:
        self.records = records

    def get(self, tenant: str, response_id: str) -> ResponseRecord | None:
        name = self._name(tenant, response_id)
        raw = self.records.unseal(tenant, name, self._get(name))
        found = self._parse(name, raw)
        if found is not None and not self._expired(found):
            return found
        return self._from_legacy(tenant, response_id) if found is None else None

    def create(self, response: ResponseRecord) -> None:
        """Keep a new response durably; ResponseExists when its id is taken."""
        name = self._name(response.tenant, response.response_id)
        raw = self.records.seal(response.tenant, name, response.to_json())
        if not self._add(name, raw, self._expiry_s(response)):
            raise ResponseExists(f"response {response.response_id} already exists")

    def delete(self, tenant: str, response_id: str) -> bool:
        gone = self._delete(self._name(tenant, response_id))
        legacy = self.records.delete(SessionKey(LEGACY_NAMESPACE + tenant, response_id))
        return gone or legacy

    def delete_tenant(self, tenant: str) -> int:
        """Delete every stored response of tenant by name (none is opened); how many."""
        return self._delete_tenant(tenant) + self.records.delete_tenant(LEGACY_NAMESPACE + tenant)

    def purge_expired(self, ttl_s: int, now: float | None = None) -> int:
        """Delete the responses older than the TTL (a backend without expiry of its own)."""
        return 0

    # -- helpers ----------------------------------------------------------------------------

    def _parse(self, name: bytes, raw: bytes | None) -> ResponseRecord | None:
        if raw is None:
            return None
        try:
            return ResponseRecord.from_json(raw)
        except (ValueError, TypeError):
            self.records.open_failures += 1
            return None

    def _expired(self, response: ResponseRecord, now: float | None = None) -> bool:
        ttl = self.records.ttl_s
        return ttl > 0 and response.created_at + ttl < (time.time() if now is None else now)

    def _expiry_s(self, response: ResponseRecord) -> int | None:
        ttl = self.records.ttl_s
        return None if ttl <= 0 else max(1, int(response.created_at + ttl - time.time()) + 1)

    def _from_legacy(self, tenant: str, response_id: str) -> ResponseRecord | None:
        key = SessionKey(LEGACY_NAMESPACE + tenant, response_id)
        old = self.records.get(key)
        if old is None or "response" not in old.metadata:
            return None
        moved = ResponseRecord(
            tenant,
            response_id,
            old.metadata["response"],
            old.metadata["session_id"],
            [{"role": m["role"], "content": m["content"]} for m in old.messages],
            old.created_at,
        )
        with contextlib.suppress(ResponseExists):  # moved meanwhile by another reader
            self.create(moved)
        self.records.delete(key)
        return moved

    # -- storage (a backend's) --------------------------------------------------------------

    @abstractmethod
    def _name(self, tenant: str, response_id: str) -> bytes: ...

    @abstractmethod
    def _get(self, name: bytes) -> bytes | None: ...

    @abstractmethod
    def _add(self, name: bytes, raw: bytes, expiry_s: int | None) -> bool:
        """Write if absent; False when the name is taken."""

    @abstractmethod
    def _delete(self, name: bytes) -> bool: ...

    @abstractmethod
    def _delete_tenant(self, tenant: str) -> int: ...
