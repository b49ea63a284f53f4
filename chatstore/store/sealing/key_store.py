"""Where the tenants' data keys live: wrapped under the master key, never in the clear.

    tenant -> TenantKeys(version, [WrappedKey(dek id, master id, nonce | AES-GCM(DEK) | tag)])

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

    def to_bytes(self) -> bytes:
        keys = [
            [k.dek_id, k.master_id, base64.b64encode(k.blob).decode(), k.created] for k in self.keys
        ]
        return json.dumps({"v": self.version, "k": keys}).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> TenantKeys:
        fields = json.loads(raw)
        keys = tuple(
            WrappedKey(str(d), str(m), base64.b64decode(b), float(c)) for d, m, b, c in fields["k"]
        )
        return cls(int(fields["v"]), keys)


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
