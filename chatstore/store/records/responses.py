"""Stored Responses (OpenAI's Responses API): their own record type and namespace.

A `ResponseRecord` is named by its tenant and response id in a namespace of its own (LMDB
keys `r:<tenant>/<digest>`, Redis `chatstore:resp:{<tenant>:<digest>}`), sealed at rest under
its tenant's key like a session record, and expires with the server's session TTL like a
session.

A chain stores each response's own items once: a response continuing another holds the items
it added (its input and its reply) and links to its parent (`previous_id`); reading its
conversation walks the links (`conversation`). Every CHAIN_BASE-th response of a chain (and one
whose parent is gone) holds its whole conversation, so a walk reads at most CHAIN_BASE records
and a chain costs O(n * n / CHAIN_BASE) bytes, not O(n^2). Deleting a response leaves its items
and link behind (a tombstone: GET answers 404, its descendants still read through it), and a
response outlives its TTL while a live one links to it (the backends' purge and expiry).

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
CHAIN_BASE = 16  # a chain's every 16th response holds its whole conversation


@dataclass
class ResponseRecord:
    tenant: str
    response_id: str
    body_json: str  # the response object as GET returns it
    session_id: str  # the session whose record and KV hold this conversation
    # Its own items (input and reply) after its parent's conversation; with no parent the
    # whole conversation through its reply.
    items: list[dict[str, str]] = field(default_factory=list)
    created_at: float = field(default_factory=time.time)
    previous_id: str = ""  # the response it continues ("": items is the whole conversation)
    length: int = 0  # how many items its whole conversation has (0: len(items), unlinked)
    depth: int = 0  # links walked to reach a response holding its whole conversation
    deleted: bool = False  # a tombstone: gone for GET, read through by its descendants

    @property
    def conversation_length(self) -> int:
        return self.length or len(self.items)

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
        """The live response (not deleted, not expired); its items are its own (see
        `conversation`)."""
        found = self._read(tenant, response_id)
        if found is not None and not found.deleted and not self._expired(found):
            return found
        return self._from_legacy(tenant, response_id) if found is None else None

    def conversation(self, response: ResponseRecord) -> list[dict[str, str]] | None:
        """The whole conversation through response, walking its links (at most CHAIN_BASE
        reads); None when a link is gone."""
        parts, current = [response.items], response
        while current.previous_id:
            parent = self._read(current.tenant, current.previous_id)
            if parent is None:
                return None
            parts.append(parent.items)
            current = parent
        return [item for part in reversed(parts) for item in part]

    def link(self, response: ResponseRecord, previous_id: str) -> ResponseRecord:
        """response (its items the whole conversation) stored as a link to previous_id when
        that one holds a prefix of it and the chain has not reached CHAIN_BASE."""
        parent = self._read(response.tenant, previous_id)
        if parent is None or parent.depth + 1 >= CHAIN_BASE:
            return response  # stored whole: a new base
        inherited = parent.conversation_length
        if inherited > len(response.items):
            return response
        response.length = len(response.items)
        response.items = response.items[inherited:]
        response.previous_id, response.depth = previous_id, parent.depth + 1
        return response

    def create(self, response: ResponseRecord) -> None:
        """Keep a new response durably; ResponseExists when its id is taken. Its ancestors
        up to the chain's base are kept at least as long (a backend with its own expiry)."""
        name = self._name(response.tenant, response.response_id)
        raw = self.records.seal(response.tenant, name, response.to_json())
        expiry_s = self._expiry_s(response)
        if not self._add(name, raw, expiry_s):
            raise ResponseExists(f"response {response.response_id} already exists")
        ancestor = response.previous_id
        for _ in range(response.depth):
            if expiry_s is None or not ancestor:
                break
            self._keep(self._name(response.tenant, ancestor), expiry_s)
            found = self._read(response.tenant, ancestor)
            ancestor = found.previous_id if found is not None else ""

    def delete(self, tenant: str, response_id: str) -> bool:
        """GET answers 404 from now on; a response that links to it reads through it (its
        tombstone keeps the items and link, and expires like it)."""
        name = self._name(tenant, response_id)
        found = self._read(tenant, response_id)
        gone = False
        if found is not None and not found.deleted:
            found.deleted, found.body_json = True, ""
            self._replace(name, self.records.seal(tenant, name, found.to_json()))
            gone = True
        legacy = self.records.delete(SessionKey(LEGACY_NAMESPACE + tenant, response_id))
        return gone or legacy

    def _read(self, tenant: str, response_id: str) -> ResponseRecord | None:
        """The stored response, tombstones and expired ones included."""
        name = self._name(tenant, response_id)
        return self._parse(name, self.records.unseal(tenant, name, self._get(name)))

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
    def _replace(self, name: bytes, raw: bytes) -> None:
        """Overwrite a stored response (a tombstone), keeping its expiry."""

    def _keep(self, name: bytes, expiry_s: int) -> None:
        """A backend with its own expiry: the response lives at least expiry_s more."""
        return None

    @abstractmethod
    def _delete(self, name: bytes) -> bool: ...

    @abstractmethod
    def _delete_tenant(self, tenant: str) -> int: ...
