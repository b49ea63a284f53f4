"""Envelope keys: per-tenant random data keys (DEKs), kept only wrapped by the master key.

    master key (master_key.py)  never stored with the data; wraps DEKs, seals nothing itself
    tenant DEK                  32 random bytes, made on the tenant's first seal; stored only as
                                AES-256-GCM(master, DEK, ad = "chatstore-dek-v1" | tenant | dek
                                id) in a key store (key_store.py); unwrapped once, then cached

Beside its DEKs a tenant has a digest key (32 random bytes, wrapped the same way): chunk names
and prefix index entries are keyed by it (chunks/keys.py), so none can be reproduced from token
ids without it. It survives data-key rotations (names stay) and goes with a shred.

Shredding a tenant deletes its wrapped keys from the key store (durably): no key material the
server holds opens its values again, on any tier or in any backup of the data. Master-key
rotation rewraps the DEKs under the newest master key (`rewrap_all`: seconds, no data is
touched); a data-key rotation gives each tenant a new DEK in front (`add_data_key`), re-seals
its values (reseal.py), then retires the old ones (`retire_data_keys`).

Replicas share one key store (the records' Redis). A DEK another replica shreds or replaces is
dropped here on its next use: every cache entry remembers the store's epoch it was read at, and
a watcher (key_watch.py) raises the epoch this keyring has seen once a second.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from chatstore.store.sealing.errors import KeyringError, KeyUnavailable, ShredFailed
from chatstore.store.sealing.key_store import KeyStore, MemoryKeyStore, TenantKeys, WrappedKey
from chatstore.store.sealing.master_key import Secret

log = logging.getLogger(__name__)

DEK_BYTES = 32
NONCE_BYTES = 12
WRAP_DOMAIN = b"chatstore-dek-v1"


@dataclass(frozen=True)
class DataKey:
    dek_id: str
    cipher: AESGCM = field(repr=False)
    key: bytes = field(repr=False)  # the raw key, for sealing a value given in parts


@dataclass(frozen=True)
class _Cached:
    epoch: int  # the store's epoch this entry was read at
    version: int
    keys: dict[str, DataKey]  # by dek id; the ones this server could unwrap
    sealing: DataKey | None  # the tenant's first key (None: not unwrappable here)
    digest_key: bytes | None  # keys the tenant's digests (None: none yet, or not unwrappable)


# A change to a tenant's keys: what it should have now (None: leave them as they are); the
# version is raised by _change.
KeyChange = Callable[[str, TenantKeys], "TenantKeys | None"]
DIGEST_ID = "h"  # the digest key's id in the wrapping's associated data


def _wrap_ad(tenant: str, dek_id: str) -> bytes:
    return WRAP_DOMAIN + b"\0" + tenant.encode() + b"\0" + dek_id.encode()


class Keyring:
    """The master secrets (first = wraps) and the tenants' data keys, unwrapped once."""

    def __init__(self, secrets_: list[Secret], store: KeyStore | None = None) -> None:
        if not secrets_:
            raise KeyringError("a keyring needs at least one secret")
        self.secrets = {s.key_id: s for s in secrets_}
        self.sealing_id = secrets_[0].key_id  # the master key that wraps
        self.store = store if store is not None else MemoryKeyStore()
        self.seen_epoch = 0  # raised by a watcher (key_watch.py); no I/O at start
        self._cache: dict[str, _Cached] = {}
        self._lock = threading.Lock()

    @property
    def key_ids(self) -> list[str]:
        return list(self.secrets)

    # -- wrapping ---------------------------------------------------------------------------

    def _master(self, key_id: str) -> AESGCM | None:
        secret = self.secrets.get(key_id)
        return AESGCM(secret.material[:32]) if secret is not None else None

    def _wrap(self, tenant: str, dek_id: str, dek: bytes, created: float) -> WrappedKey:
        master = self._master(self.sealing_id)
        assert master is not None  # the wrapping secret is always held
        nonce = os.urandom(NONCE_BYTES)
        blob = nonce + master.encrypt(nonce, dek, _wrap_ad(tenant, dek_id))
        return WrappedKey(dek_id, self.sealing_id, blob, created)

    def _unwrap(self, tenant: str, wrapped: WrappedKey) -> bytes | None:
        """The DEK, or None when this server lacks (or holds another) master key wrapping it."""
        master = self._master(wrapped.master_id)
        if master is None:
            return None
        nonce, body = wrapped.blob[:NONCE_BYTES], wrapped.blob[NONCE_BYTES:]
        try:
            return master.decrypt(nonce, body, _wrap_ad(tenant, wrapped.dek_id))
        except InvalidTag:
            return None

    def _new_key(self, tenant: str, dek_id: str) -> WrappedKey:
        return self._wrap(tenant, dek_id, os.urandom(DEK_BYTES), time.time())

    # -- the cache --------------------------------------------------------------------------

    def _entry(self, tenant: str, create: bool) -> _Cached | None:
        """tenant's keys as cached (read again when the store's epoch moved past the entry);
        None when it has none (and `create` is off)."""
        cached = self._cache.get(tenant)
        if cached is not None and cached.epoch >= self.seen_epoch:
            return cached
        epoch = self.seen_epoch
        stored = self.store.load(tenant)
        if stored is None and create:
            first = (self._new_key(tenant, "d1"),)
            stored = self.store.create(
                tenant, TenantKeys(1, first, self._new_key(tenant, DIGEST_ID))
            )
        if stored is None:
            with self._lock:
                self._cache.pop(tenant, None)
            return None
        if cached is not None and cached.version == stored.version:
            entry = _Cached(epoch, cached.version, cached.keys, cached.sealing, cached.digest_key)
        else:
            entry = self._unwrapped(tenant, stored, epoch)
        with self._lock:
            self._cache[tenant] = entry
        return entry

    def _unwrapped(self, tenant: str, stored: TenantKeys, epoch: int) -> _Cached:
        keys: dict[str, DataKey] = {}
        for wrapped in stored.keys:
            dek = self._unwrap(tenant, wrapped)
            if dek is not None:
                keys[wrapped.dek_id] = DataKey(wrapped.dek_id, AESGCM(dek), dek)
            else:
                log.warning(
                    "tenant %r: data key %s is wrapped by master key %r, which this server "
                    "lacks or holds with other bytes: its values do not open here",
                    tenant, wrapped.dek_id, wrapped.master_id,
                )  # fmt: skip
        sealing = keys.get(stored.keys[0].dek_id)
        digest = self._unwrap(tenant, stored.digest) if stored.digest is not None else None
        return _Cached(epoch, stored.version, keys, sealing, digest)

    def observe_epoch(self, epoch: int) -> None:
        """The store's epoch as a watcher read it: entries older are read again on next use."""
        if epoch > self.seen_epoch:
            self.seen_epoch = epoch

    def refresh(self, epoch: int) -> list[str]:
        """Read every cached tenant's keys again (a watcher's thread, once the store's epoch
        moved to `epoch`), so that a use (the engine's thread) rarely reads the store itself;
        then raise the epoch seen. The tenants whose keys changed or went."""
        changed = []
        for tenant in list(self._cache):
            stored = self.store.load(tenant)
            with self._lock:
                cached = self._cache.get(tenant)
                if stored is None:
                    self._cache.pop(tenant, None)
                elif cached is not None and cached.version == stored.version:
                    self._cache[tenant] = dataclasses.replace(cached, epoch=epoch)
                    continue
            if stored is not None:
                entry = self._unwrapped(tenant, stored, epoch)
                with self._lock:
                    self._cache[tenant] = entry
            changed.append(tenant)
        self.observe_epoch(epoch)
        return changed

    # -- what the sealer asks ---------------------------------------------------------------

    def sealing_key(self, tenant: str) -> DataKey:
        """The key tenant's new values are sealed under (made on its first seal);
        KeyUnavailable when this server cannot unwrap it."""
        entry = self._entry(tenant, create=True)
        assert entry is not None
        if entry.sealing is None:
            raise KeyUnavailable(
                f"tenant {tenant!r}: its data key is wrapped by a master key this server does "
                f"not hold: give every replica the same master key"
            )
        return entry.sealing

    def digest_key(self, tenant: str) -> bytes:
        """The key of tenant's digests (chunk names, prefix index entries): 32 random bytes
        kept wrapped with its data keys, so only this server's keys reproduce a digest, and a
        shred makes every digest of the tenant meaningless. KeyUnavailable as sealing_key."""
        entry = self._entry(tenant, create=True)
        assert entry is not None
        if entry.digest_key is None and self._change(tenant, self._with_digest):
            entry = self._entry(tenant, create=True)  # keys made before digest keys: one now
            assert entry is not None
        if entry.digest_key is None:
            raise KeyUnavailable(
                f"tenant {tenant!r}: its digest key is wrapped by a master key this server "
                f"does not hold: give every replica the same master key"
            )
        return entry.digest_key

    def _with_digest(self, tenant: str, stored: TenantKeys) -> TenantKeys | None:
        if stored.digest is not None:
            return None
        return dataclasses.replace(stored, digest=self._new_key(tenant, DIGEST_ID))

    def opening_key(self, tenant: str, dek_id: str) -> DataKey | None:
        """tenant's key dek_id (None: shredded, retired, or not unwrappable here)."""
        entry = self._entry(tenant, create=False)
        return entry.keys.get(dek_id) if entry is not None else None

    def sealing_dek_id(self, tenant: str) -> str | None:
        """The id of the key tenant's values are sealed under now (None: it has no key)."""
        entry = self._entry(tenant, create=False)
        return entry.sealing.dek_id if entry is not None and entry.sealing else None

    # -- shredding and rotation -------------------------------------------------------------

    def shred(self, tenant: str) -> bool:
        """Destroy tenant's data keys in the key store (durably) and here; whether it had any.
        Its values never open again; its later data is sealed under a fresh key."""
        try:
            found = self.store.delete(tenant)
        except Exception as exc:  # Redis out of reach: the key stands, so must the data
            raise ShredFailed(
                f"tenant {tenant!r}: the key store did not take the shred ({exc}): retry"
            ) from exc
        with self._lock:
            self._cache.pop(tenant, None)
        log.warning("tenant %r: its data keys were destroyed (crypto-shredded)", tenant)
        return found

    def rewrap_all(self) -> int:
        """Master-key rotation: every data key wrapped by an older master key is wrapped by
        the newest one (no value is touched); how many tenants changed."""
        changed = 0
        for tenant in self.store.tenants():
            changed += self._change(tenant, self._rewrapped)
        return changed

    def _rewrapped(self, tenant: str, stored: TenantKeys) -> TenantKeys | None:
        every = [*stored.keys, *([stored.digest] if stored.digest is not None else [])]
        if all(k.master_id == self.sealing_id for k in every):
            return None
        out = []
        for wrapped in every:
            dek = self._unwrap(tenant, wrapped)
            if dek is None:
                raise KeyUnavailable(
                    f"tenant {tenant!r}: data key {wrapped.dek_id} is wrapped by master key "
                    f"{wrapped.master_id!r}, which this server lacks: keep it in the keyring "
                    f"until every data key is rewrapped"
                )
            out.append(self._wrap(tenant, wrapped.dek_id, dek, wrapped.created))
        if stored.digest is not None:
            return dataclasses.replace(stored, keys=tuple(out[:-1]), digest=out[-1])
        return dataclasses.replace(stored, keys=tuple(out))

    def add_data_key(self, tenant: str, older_than: float) -> bool:
        """Data-key rotation: a new key in front of tenant's if its sealing key was made
        before older_than (so a resumed rotation adds none twice); whether one was added."""

        def added(tenant: str, stored: TenantKeys) -> TenantKeys | None:
            if stored.keys[0].created >= older_than:
                return None
            number = 1 + max(int(k.dek_id.lstrip("d") or 0) for k in stored.keys)
            keys = (self._new_key(tenant, f"d{number}"), *stored.keys)
            return dataclasses.replace(stored, keys=keys)

        return bool(self._change(tenant, added))

    def retire_data_keys(self, tenant: str) -> bool:
        """Drop every key of tenant but its sealing one (a finished data-key rotation)."""

        def retired(tenant: str, stored: TenantKeys) -> TenantKeys | None:
            if len(stored.keys) == 1:
                return None
            return dataclasses.replace(stored, keys=stored.keys[:1])

        return bool(self._change(tenant, retired))

    def _change(self, tenant: str, change: KeyChange) -> int:
        """Apply change(tenant, stored) -> new keys (None: nothing to do) by compare-and-set,
        again if another writer won; 1 if changed."""
        while True:
            stored = self.store.load(tenant)
            if stored is None:
                return 0
            changed = change(tenant, stored)
            if changed is None:
                return 0
            new = dataclasses.replace(changed, version=stored.version + 1)
            if self.store.replace(tenant, stored.version, new):
                with self._lock:
                    self._cache.pop(tenant, None)
                return 1
