"""The data keys of one server in an LMDB environment beside the records.

    <data_dir>/keys.lmdb   tenant (UTF-8) -> TenantKeys bytes (wrapped under the master key)

Its own environment, not a table inside records.lmdb, so that restoring a backup of the records
does not bring back the keys of tenants shredded since (docs/security.md says what a backup of
this file does). Synchronous commits (`sync`, `metasync`): a shred's delete is on the disk when
it returns. One process owns it, so its epoch is a counter of this process's changes.
"""

from __future__ import annotations

import threading
from pathlib import Path

from chatstore.store.sealing.key_store import KeyStore, TenantKeys

FILE_NAME = "keys.lmdb"


class LmdbKeyStore(KeyStore):
    def __init__(self, path: str | Path, map_size: int = 64 << 20) -> None:
        from chatstore.store.tiers.lmdb import open_private  # not at import: tiers import sealing

        self.path = Path(path)
        self.env = open_private(self.path, map_size=map_size, sync=True, metasync=True)
        self._epoch = 0
        self._lock = threading.Lock()

    def load(self, tenant: str) -> TenantKeys | None:
        with self.env.begin() as txn:
            raw = txn.get(tenant.encode())
        return TenantKeys.from_bytes(raw) if raw is not None else None

    def create(self, tenant: str, keys: TenantKeys) -> TenantKeys:
        with self.env.begin(write=True) as txn:
            raw = txn.get(tenant.encode())
            if raw is not None:
                return TenantKeys.from_bytes(raw)
            txn.put(tenant.encode(), keys.to_bytes())
        return keys

    def replace(self, tenant: str, expected_version: int, keys: TenantKeys) -> bool:
        with self.env.begin(write=True) as txn:
            raw = txn.get(tenant.encode())
            if raw is None or TenantKeys.from_bytes(raw).version != expected_version:
                return False
            txn.put(tenant.encode(), keys.to_bytes())
        self._bump()
        return True

    def delete(self, tenant: str) -> bool:
        with self.env.begin(write=True) as txn:
            found = txn.delete(tenant.encode())
        self.env.sync(True)  # committed synchronously already; the page is on the disk
        self._bump()
        return bool(found)

    def tenants(self) -> list[str]:
        with self.env.begin() as txn:
            return [bytes(k).decode() for k, _ in txn.cursor()]

    def epoch(self) -> int:
        return self._epoch

    def _bump(self) -> None:
        with self._lock:
            self._epoch += 1

    def close(self) -> None:
        self.env.close()
