"""Where the tenants' data keys live: wrapped under the master key, never in the clear.

    tenant -> TenantKeys(version, [WrappedKey(dek id, master id, nonce | AES-GCM(DEK) | tag)],
                         digest key: wrapped the same way)

The first key of a tenant seals its new values; the others (a data-key rotation under way)
still open the values sealed under them. Every change raises the tenant's version and the
store's epoch: a replica that cached a key checks the epoch (key_watch.py) and loads again.

Backends: LMDB beside the records (key_store_lmdb.py: one server), the records' Redis
(key_store_redis.py: replicas share it, never under an eviction policy), and memory (this
module: a keyring no other process shares, as tools and unit tests use). `delete` is durable
before it returns (LMDB: a synchronous commit; Redis: its own persistence, AOF): once a
tenant's entry is gone, nothing this server holds opens its values again.
"""

from __future__ import annotations

import base64
import json
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class WrappedKey:
    dek_id: str  # named in every value it seals ("d1", "d2", ...)
    master_id: str  # the master key that wraps it
    blob: bytes  # nonce (12) | AES-256-GCM(DEK) | tag (16); associated data: tenant, dek id
    created: float  # when it was made (a data-key rotation replaces the keys made before it)


@dataclass(frozen=True)
class TenantKeys:
    version: int
    keys: tuple[WrappedKey, ...]  # the first seals
    # The key of the tenant's digests (chunk names, prefix index): kept across data-key
    # rotations (the names stay), destroyed with the data keys by a shred.
    digest: WrappedKey | None = None

    def to_bytes(self) -> bytes:
        fields: dict = {"v": self.version, "k": [_listed(k) for k in self.keys]}
        if self.digest is not None:
            fields["h"] = _listed(self.digest)
        return json.dumps(fields).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> TenantKeys:
        fields = json.loads(raw)
        keys = tuple(_wrapped(k) for k in fields["k"])
        digest = _wrapped(fields["h"]) if "h" in fields else None
        return cls(int(fields["v"]), keys, digest)


def _listed(key: WrappedKey) -> list[str | float]:
    return [key.dek_id, key.master_id, base64.b64encode(key.blob).decode(), key.created]


def _wrapped(fields: list) -> WrappedKey:
    dek_id, master_id, blob, created = fields
    return WrappedKey(str(dek_id), str(master_id), base64.b64decode(blob), float(created))


class KeyStore(ABC):
    """The wrapped data keys of every tenant (module doc)."""

    @abstractmethod
    def load(self, tenant: str) -> TenantKeys | None: ...

    @abstractmethod
    def create(self, tenant: str, keys: TenantKeys) -> TenantKeys:
        """Store keys if the tenant has none; what the tenant has now (another replica's keys
        when it was first)."""

    @abstractmethod
    def replace(self, tenant: str, expected_version: int, keys: TenantKeys) -> bool:
        """Store keys if the tenant's are still at expected_version; whether they were."""

    @abstractmethod
    def delete(self, tenant: str) -> bool:
        """Destroy the tenant's keys, durably before returning; whether it had any."""

    @abstractmethod
    def tenants(self) -> list[str]: ...

    @abstractmethod
    def epoch(self) -> int:
        """A number every replace and delete raises (a cached key older than it is checked)."""

    def close(self) -> None:
        return None


class MemoryKeyStore(KeyStore):
    """Keys for this process only: gone at exit, so nothing sealed under them opens again."""

    def __init__(self) -> None:
        self._keys: dict[str, TenantKeys] = {}
        self._epoch = 0
        self._lock = threading.Lock()

    def load(self, tenant: str) -> TenantKeys | None:
        return self._keys.get(tenant)

    def create(self, tenant: str, keys: TenantKeys) -> TenantKeys:
        with self._lock:
            return self._keys.setdefault(tenant, keys)

    def replace(self, tenant: str, expected_version: int, keys: TenantKeys) -> bool:
        with self._lock:
            current = self._keys.get(tenant)
            if current is None or current.version != expected_version:
                return False
            self._keys[tenant] = keys
            self._epoch += 1
            return True

    def delete(self, tenant: str) -> bool:
        with self._lock:
            self._epoch += 1
            return self._keys.pop(tenant, None) is not None

    def tenants(self) -> list[str]:
        return sorted(self._keys)

    def epoch(self) -> int:
        return self._epoch
