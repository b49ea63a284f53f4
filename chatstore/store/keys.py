"""Stable byte keys for sessions in the LMDB and Redis tiers (any tenant / session string)."""

from __future__ import annotations

import hashlib
import json
from urllib.parse import quote

from chatstore.store.session_kv import SessionKey


def key_digest(key: SessionKey) -> str:
    """32 hex chars naming a session: short, fixed-length, any characters in the ids."""
    blob = json.dumps([key.tenant, key.session_id]).encode()
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


def redis_prefix(namespace: str, fingerprint: str, tenant: str) -> str:
    """`<ns>:<model fingerprint>:<tenant>:` — keys of another model or tenant never collide."""
    return f"{namespace}:{fingerprint}:{quote(tenant, safe='')}:"
