"""Encryption at rest: per-tenant AES-256-GCM seals of every value written to LMDB or Redis,
under envelope keys.

master_key.py      where the master key comes from (never the data directory)
key_store.py       the tenants' wrapped data keys: the contract, and memory
key_store_lmdb.py  ... in LMDB beside the records (one server)
key_store_redis.py ... in the records' Redis (replicas)
keyring.py         data keys: made, unwrapped once, cached; shredding, rewrapping, rotation
key_watch.py       replicas drop a data key another replica changed
sealer.py          the sealed value format, seal / open (OpenError), associated data
reseal.py          the background re-seal (data-key rotation, encrypt-existing, migrate-v1),
                   resumable
legacy_v1.py       opening values sealed by version 1, for the records' migration only
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from chatstore.store.sealing.errors import KeyringError, KeyUnavailable, ShredFailed
from chatstore.store.sealing.key_store import KeyStore
from chatstore.store.sealing.keyring import Keyring
from chatstore.store.sealing.master_key import load_master_secrets
from chatstore.store.sealing.sealer import OpenError, Sealer

log = logging.getLogger(__name__)

# The purposes in the associated data: a chunk can never open as a record, nor the reverse.
KV_PURPOSE = b"kv"
RECORD_PURPOSE = b"rec"

__all__ = [
    "KV_PURPOSE",
    "RECORD_PURPOSE",
    "KeyStore",
    "KeyUnavailable",
    "Keyring",
    "KeyringError",
    "OpenError",
    "Sealer",
    "ShredFailed",
    "load_master_secrets",
    "sealer_for",
]


def sealer_for(
    encrypt_at_rest: bool,
    data_dir: Path,
    key_store: Callable[[], KeyStore],
    secret_key: str = "",
    secret_key_file: str = "",
    replicas: bool = False,
) -> Sealer | None:
    """The server's sealer over the key store key_store() opens (after the master key is
    found: a start it refuses opens nothing), or None (and a warning) when encryption at rest
    is off. replicas: a Redis URL is set (a generated master key is refused)."""
    if not encrypt_at_rest:
        log.warning(
            "encrypt_at_rest = false: session records and KV are stored in the clear in %s "
            "(and in Redis, if configured)",
            data_dir,
        )
        return None
    secrets = load_master_secrets(data_dir, secret_key, secret_key_file, replicas)
    keyring = Keyring(secrets, key_store())
    log.info(
        "encryption at rest on: AES-256-GCM per tenant data key, wrapped by master key %r "
        "(%d master key(s) held)",
        keyring.sealing_id,
        len(keyring.key_ids),
    )
    return Sealer(keyring)
