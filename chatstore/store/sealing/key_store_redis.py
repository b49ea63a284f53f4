"""The tenants' data keys in the records' Redis, shared by every replica.

    chatstore:keys:{dek}         hash: tenant -> TenantKeys bytes (wrapped under the master key)
    chatstore:keys:{dek}:epoch   raised by every replace and delete

Both names carry the hash tag `{dek}`, so a cluster keeps them in one slot and a change and its
epoch are one transaction (a Lua script). The Redis must be the records' own, `noeviction`
with AOF (docs/replicas.md): evicting this hash would lose every tenant's data, and AOF with
`appendfsync always` is what makes a shred's delete durable there. No TTL is ever set.
"""

from __future__ import annotations

from typing import Any

from chatstore.store.sealing.key_store import KeyStore, TenantKeys

HASH = "chatstore:keys:{dek}"
EPOCH = "chatstore:keys:{dek}:epoch"

# Replace ARGV[1]'s keys with ARGV[3] if their version is still ARGV[2]; 1 if replaced.
_REPLACE = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
if tonumber(cjson.decode(raw)['v']) ~= tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
redis.call('INCR', KEYS[2])
return 1
"""
# Delete ARGV[1]'s keys and raise the epoch; 1 if it had any.
_DELETE = """
local found = redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('INCR', KEYS[2])
return found
"""


class RedisKeyStore(KeyStore):
    def __init__(self, client: Any) -> None:
        self.client = client
        self._replace = client.register_script(_REPLACE)
        self._delete = client.register_script(_DELETE)

    def load(self, tenant: str) -> TenantKeys | None:
        raw = self.client.hget(HASH, tenant)
        return TenantKeys.from_bytes(raw) if raw is not None else None

    def create(self, tenant: str, keys: TenantKeys) -> TenantKeys:
        if self.client.hsetnx(HASH, tenant, keys.to_bytes()):
            return keys
        stored = self.load(tenant)
        return stored if stored is not None else self.create(tenant, keys)  # deleted meanwhile

    def replace(self, tenant: str, expected_version: int, keys: TenantKeys) -> bool:
        args = [tenant, expected_version, keys.to_bytes()]
        return bool(self._replace(keys=[HASH, EPOCH], args=args))

    def delete(self, tenant: str) -> bool:
        return bool(self._delete(keys=[HASH, EPOCH], args=[tenant]))

    def tenants(self) -> list[str]:
        return sorted(t.decode() if isinstance(t, bytes) else t for t in self.client.hkeys(HASH))

    def epoch(self) -> int:
        return int(self.client.get(EPOCH) or 0)
