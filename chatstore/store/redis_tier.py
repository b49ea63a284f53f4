"""Remote tier: session KV in Redis, shared by replicas of the same model.

    <ns>:<fingerprint>:<tenant>:<digest>:meta   JSON {tenant, session_id, chunks, footprint}
    <ns>:<fingerprint>:<tenant>:<digest>:c:<i>  one chunk of the encoded value (codec.py)

Every key has the session TTL. Chunks are written before meta in one MULTI/EXEC, and a reader
that finds a chunk missing (expired, evicted by Redis) treats the value as a miss. Occupancy is
this process's view of what it wrote (rebuilt by SCAN at start), bounded by `capacity_bytes`.

Threads: the client is thread-safe (a connection pool) and the local index is a FootprintIndex,
so reads from one thread and writes from another may overlap.
"""

from __future__ import annotations

import json
from typing import Any

from chatstore.store import codec
from chatstore.store.keys import key_digest, redis_prefix
from chatstore.store.lmdb_tier import encoded_footprint
from chatstore.store.session_kv import SessionKey, SessionKV
from chatstore.store.tier import FootprintIndex, StorageTier

NAMESPACE = "chatstore:kv"


class RedisTier(StorageTier):
    name = "remote"

    def __init__(
        self,
        url_or_client: str | Any,
        capacity_bytes: int,
        fingerprint: str,
        ttl_s: int = 86400,
        chunk_bytes: int = 1 << 20,
    ) -> None:
        import redis

        if isinstance(url_or_client, str):
            self.client = redis.Redis.from_url(url_or_client)
        else:
            self.client = url_or_client
        self.fingerprint = fingerprint
        self.ttl_s = ttl_s
        self.chunk_bytes = chunk_bytes
        self._capacity = capacity_bytes
        self._index = FootprintIndex()
        self._rebuild_index()

    def _base(self, key: SessionKey) -> str:
        return redis_prefix(NAMESPACE, self.fingerprint, key.tenant) + key_digest(key)

    def _rebuild_index(self) -> None:
        pattern = f"{NAMESPACE}:{self.fingerprint}:*:meta"
        for name in self.client.scan_iter(match=pattern, count=1000):
            raw = self.client.get(name)
            if raw is not None:
                meta = json.loads(raw)
                key = SessionKey(meta["tenant"], meta["session_id"])
                self._index.set(key, int(meta["footprint"]))

    @property
    def capacity(self) -> int:
        return self._capacity

    def footprint(self, value: SessionKV) -> int:
        return encoded_footprint(value)

    def put(self, key: SessionKey, value: SessionKV) -> None:
        need = self.check_fits(key, value)
        base = self._base(key)
        chunks = codec.split_chunks(codec.encode(value, self.fingerprint), self.chunk_bytes)
        meta = {"tenant": key.tenant, "session_id": key.session_id, "chunks": len(chunks)}
        meta["footprint"] = need
        old = self._chunk_count(base)
        ttl = self.ttl_s if self.ttl_s > 0 else None
        with self.client.pipeline(transaction=True) as pipe:
            for i in range(len(chunks), old):
                pipe.delete(f"{base}:c:{i}")
            for i, chunk in enumerate(chunks):
                pipe.set(f"{base}:c:{i}", chunk, ex=ttl)
            pipe.set(f"{base}:meta", json.dumps(meta), ex=ttl)
            pipe.execute()
        self._index.set(key, need)

    def _chunk_count(self, base: str) -> int:
        raw = self.client.get(f"{base}:meta")
        return int(json.loads(raw)["chunks"]) if raw is not None else 0

    def get(self, key: SessionKey) -> SessionKV | None:
        base = self._base(key)
        n = self._chunk_count(base)
        if n == 0:
            self._index.pop(key)
            return None
        chunks = self.client.mget([f"{base}:c:{i}" for i in range(n)])
        if any(c is None for c in chunks):
            self.delete(key)
            return None
        try:
            return codec.decode(codec.join_chunks(chunks), self.fingerprint)
        except (codec.CorruptValueError, codec.FingerprintMismatch):
            self.delete(key)
            raise

    def delete(self, key: SessionKey) -> bool:
        base = self._base(key)
        n = self._chunk_count(base)
        self.client.delete(f"{base}:meta", *[f"{base}:c:{i}" for i in range(n)])
        return self._index.pop(key) or n > 0

    def contains(self, key: SessionKey) -> bool:
        if self.client.exists(f"{self._base(key)}:meta"):
            return True
        self._index.pop(key)
        return False

    def used_bytes(self) -> int:
        return self._index.total

    def keys(self) -> list[SessionKey]:
        return self._index.keys()

    def size_of(self, key: SessionKey) -> int:
        return self._index.size_of(key)

    def close(self) -> None:
        self.client.close()
