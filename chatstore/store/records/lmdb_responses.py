"""The LMDB record store's Responses namespace: `r:<tenant>/<digest>`, created only if absent;
the purge reads the namespace (a response's expiry is its creation plus the server's TTL)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

from chatstore.store.record_keys import key_digest
from chatstore.store.records.lmdb_facts import key_range as _range
from chatstore.store.records.lmdb_facts import tenant_of as _tenant_of
from chatstore.store.records.responses import ResponseRecord, ResponseRecords, SealedRecords
from chatstore.store.session_kv import SessionKey

if TYPE_CHECKING:
    from lmdb import Environment, Transaction

RESPONSES = b"r:"
T = TypeVar("T")


class LmdbRecords(SealedRecords, Protocol):
    """What the namespace uses of the LMDB record store (lmdb.py)."""

    env: Environment

    def _write(self, fn: Callable[[Transaction[bytes]], T]) -> T: ...

    def _prefix(self, tenant: str, space: bytes = ...) -> bytes: ...

    def _check_room(self, nbytes: int) -> None: ...


class LmdbResponses(ResponseRecords):
    records: LmdbRecords

    def _name(self, tenant: str, response_id: str) -> bytes:
        digest = key_digest(SessionKey(tenant, response_id))
        return self.records._prefix(tenant, RESPONSES) + digest.encode()

    def _get(self, name: bytes) -> bytes | None:
        with self.records.env.begin() as txn:
            raw = txn.get(name)
        return None if raw is None else bytes(raw)

    def _add(self, name: bytes, raw: bytes, expiry_s: int | None) -> bool:
        self.records._check_room(len(raw))
        return bool(self.records._write(lambda txn: txn.put(name, raw, overwrite=False)))

    def _replace(self, name: bytes, raw: bytes) -> None:
        self.records._write(lambda txn: txn.put(name, raw))

    def _delete(self, name: bytes) -> bool:
        return bool(self.records._write(lambda txn: txn.delete(name)))

    def _delete_tenant(self, tenant: str) -> int:
        prefix = self.records._prefix(tenant, RESPONSES)

        def drop(txn: Transaction[bytes]) -> int:
            names = [n for n, _ in _range(txn, prefix)]
            for name in names:
                txn.delete(name)
            return len(names)

        return int(self.records._write(drop))

    def purge_expired(self, ttl_s: int, now: float | None = None) -> int:
        """Delete the expired responses no live response links to (directly or through
        other links)."""
        if ttl_s <= 0:
            return 0
        now = time.time() if now is None else now
        with self.records.env.begin() as txn:
            found = _range(txn, RESPONSES)
        stored: dict[bytes, ResponseRecord] = {}
        for name, raw in found:
            response = self._parse(name, self.records.unseal(_tenant_of(name), name, raw))
            if response is not None:
                stored[name] = response
        linked: set[bytes] = set()
        for response in stored.values():
            if self._expired(response, now):
                continue
            current = response
            while current.previous_id:
                parent_name = self._name(current.tenant, current.previous_id)
                parent = stored.get(parent_name)
                if parent is None or parent_name in linked:
                    break
                linked.add(parent_name)
                current = parent
        gone = [n for n, r in stored.items() if self._expired(r, now) and n not in linked]
        for name in gone:
            self._delete(name)
        return len(gone)
