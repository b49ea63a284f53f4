"""Encryption at rest: per-tenant AES-256-GCM seals of every value written to LMDB or Redis.

keyring.py  server secrets (key ids, rotation) and per-tenant keys derived by HKDF; shredding
sealer.py   the sealed value format, seal / open (OpenError), associated data
reseal.py   the background re-seal under the newest key (rotation), resumable
shared_shreds.py  the shred list replicas share in Redis
"""

from __future__ import annotations

import logging
from pathlib import Path

from chatstore.store.sealing.keyring import Keyring, KeyringError, load_keyring
from chatstore.store.sealing.sealer import OpenError, Sealer

log = logging.getLogger(__name__)

# The purposes in the associated data: a chunk can never open as a record, nor the reverse.
KV_PURPOSE = b"kv"
RECORD_PURPOSE = b"rec"

__all__ = [
    "KV_PURPOSE",
    "RECORD_PURPOSE",
    "Keyring",
    "KeyringError",
    "OpenError",
    "Sealer",
    "load_keyring",
    "sealer_for",
]


def sealer_for(
    encrypt_at_rest: bool, data_dir: Path, secret_key: str = "", secret_key_file: str = ""
) -> Sealer | None:
    """The server's sealer, or None (and a warning) when encryption at rest is off."""
    if not encrypt_at_rest:
        log.warning(
            "encrypt_at_rest = false: session records and KV are stored in the clear in %s "
            "(and in Redis, if configured)",
            data_dir,
        )
        return None
    keyring = load_keyring(data_dir, secret_key, secret_key_file)
    log.info(
        "encryption at rest on: AES-256-GCM per tenant, sealing key id %r (%d key(s) open)",
        keyring.sealing_id,
        len(keyring.key_ids),
    )
    return Sealer(keyring)
