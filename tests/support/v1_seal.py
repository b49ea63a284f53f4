"""Records sealed as version 1 wrote them (before envelope keys), for the migration's tests.

Written from the format alone (git show 705bb57:chatstore/store/sealing/), not from
chatstore/store/sealing/legacy_v1.py, so that a test of the migration checks it against the
old format rather than against itself:

    value = 0x01 | len(key id) | key id | nonce (12) | AES-256-GCM(key, nonce, plain, ad)
    key   = HKDF-SHA256(secret, salt = b"chatstore-at-rest-v1",
                        info = owner.encode() + b"\\0" + str(generation).encode(), 32 bytes)
    ad    = purpose + b"\\0" + tenant.encode() + b"\\0" + name

`owner` is the tenant, or for an internal namespace ("\\x00responses:<tenant>") the tenant after
the colon. `to_v1_lmdb` / `to_v1_redis` rewrite every record value of a store (sessions'
headers and log entries, stored Responses), opened with the store's own sealer, as version 1.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import lmdb
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from chatstore.store.sealing import RECORD_PURPOSE, Sealer
from chatstore.store.sealing.master_key import Secret

RECORD_SPACES = (b"r:", b"t:", b"u:")  # LMDB: Responses, session headers, their logs


def v1_seal(
    secret: Secret, generation: int, purpose: bytes, tenant: str, name: bytes, plain: bytes
) -> bytes:
    owner = tenant.split(":", 1)[1] if tenant.startswith("\x00") and ":" in tenant else tenant
    info = owner.encode() + b"\0" + str(generation).encode()
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=b"chatstore-at-rest-v1", info=info)
    nonce = os.urandom(12)
    kid = secret.key_id.encode()
    ad = purpose + b"\0" + tenant.encode() + b"\0" + name
    sealed = AESGCM(key.derive(secret.material)).encrypt(nonce, plain, ad)
    return bytes((1, len(kid))) + kid + nonce + sealed


def _lmdb_tenant(name: bytes) -> str:
    return unquote(name[2:].decode().split("/", 1)[0])


def _redis_tenant(name: str) -> str:
    return unquote(name[name.index("{") + 1 :].rsplit(":", 1)[0])


def to_v1_lmdb(path: Path, sealer: Sealer, secret: Secret, generation: int = 0) -> int:
    """Every record value of the LMDB record store at path (closed) rewritten as version 1
    sealed it (under `generation` for every tenant); how many."""
    env = lmdb.open(str(path), subdir=True)
    done = 0
    with env.begin(write=True) as txn:
        for name, raw in list(txn.cursor()):
            name, raw = bytes(name), bytes(raw)
            if name[:2] not in RECORD_SPACES:
                continue
            tenant = _lmdb_tenant(name)
            plain = sealer.open(RECORD_PURPOSE, tenant, name, raw)
            txn.put(name, v1_seal(secret, generation, RECORD_PURPOSE, tenant, name, plain))
            done += 1
    env.close()
    return done


def to_v1_redis(client: Any, sealer: Sealer, secret: Secret, generation: int = 0) -> int:
    """Every record value in Redis (chatstore:rec:, chatstore:resp:, the logs' entries)
    rewritten as version 1 sealed it; how many."""
    done = 0
    for prefix in ("chatstore:rec:", "chatstore:resp:"):
        for raw_name in client.scan_iter(match=f"{prefix}*"):
            name = raw_name.decode()
            tenant, ad = _redis_tenant(name), name.encode()
            plain = sealer.open(RECORD_PURPOSE, tenant, ad, client.get(name))
            client.set(
                name, v1_seal(secret, generation, RECORD_PURPOSE, tenant, ad, plain), keepttl=True
            )
            done += 1
    for raw_name in client.scan_iter(match="chatstore:log:*"):
        name = raw_name.decode()
        tenant = _redis_tenant(name)
        for i, raw in enumerate(client.lrange(name, 0, -1)):
            ad = f"{name}/{i:08x}".encode()  # an entry's place in its log (redis_log.entry_ad)
            plain = sealer.open(RECORD_PURPOSE, tenant, ad, raw)
            client.lset(name, i, v1_seal(secret, generation, RECORD_PURPOSE, tenant, ad, plain))
            done += 1
    return done
