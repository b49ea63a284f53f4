"""Stable keys for session records in LMDB and Redis (any tenant / session string)."""

from __future__ import annotations

import hashlib
import json

from chatstore.store.session_kv import SessionKey


def key_digest(key: SessionKey) -> str:
    """32 hex chars naming a session: short, fixed-length, any characters in the ids."""
    blob = json.dumps([key.tenant, key.session_id]).encode()
    return hashlib.blake2b(blob, digest_size=16).hexdigest()
