"""A real server with two tenants (API keys `key-alice` and `key-bob`) and an admin key over a
data directory, and a conversation on it that plants a marker: what the encryption-at-rest
tests (tests/store/sealing/test_security_at_rest.py) and `admin migrate-v1`'s look for in the
bytes at rest."""

from __future__ import annotations

from pathlib import Path

import httpx

from chatstore.api.common.settings import ServerSettings
from chatstore.server.launcher import local_server

ADMIN = "key-admin"
KEYS = {"key-alice": "alice", "key-bob": "bob"}
GREEDY = {"temperature": 0, "max_tokens": 4}


def converse(url: str, marker: str, key: str = "key-alice") -> str:
    """A new session (system prompt "Be brief.") told the marker and asked to repeat it, greedy;
    its id."""
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=url, headers=headers, timeout=120, trust_env=False) as c:
        sid = c.post("/v1/sessions", json={"system_prompt": "Be brief."}).json()["id"]
        for text in (f"Remember the code {marker}.", "Say it again."):
            reply = c.post(f"/v1/sessions/{sid}/messages", json={"content": text, **GREEDY})
            assert reply.status_code == 200, reply.text
    return sid


def tenant_server(data: Path, model, **overrides):
    """local_server over `data` with the two tenants and the admin key (32 MiB of KV cache,
    64 MiB of DRAM tier), not started; overrides are config keys (secret_key, persist, ...)."""
    settings = ServerSettings(api_keys=KEYS, admin_key=ADMIN)
    return local_server(
        data, model, settings, kv_cache_bytes=32 << 20, dram_bytes=64 << 20, **overrides
    )
