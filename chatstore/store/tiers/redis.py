"""Remote tier: KV chunks in Redis, shared by replicas of the same model.

    chatstore:kv:<fingerprint>:<tenant>:{<digest>}   the encoded chunk (codec.py), with a TTL

One key per chunk; the hash tag `{<digest>}` pins everything of a chunk to one Redis Cluster
slot. Chunks are content-addressed, so a chunk another replica wrote is as good as our own, and
writing a key that exists changes nothing. Occupancy is this process's view of what it wrote
(rebuilt by SCAN at start), bounded by `capacity_bytes`. A chunk Redis expired or evicted reads
as a miss. `get_many` / `put_many` batch chunks in one pipeline.

Threads: the client is thread-safe (a connection pool), the index is a FootprintIndex.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote, unquote

from chatstore.store.chunks import ChunkKey
from chatstore.store.session_kv import SessionKV
from chatstore.store.tiers import codec
from chatstore.store.tiers.base import IndexedTier

NAMESPACE = "chatstore:kv"


class RedisTier(IndexedTier):
    name = "remote"

    def __init__(
        self, url_or_client: str | Any, capacity_bytes: int, fingerprint: str, ttl_s: int = 86400
    ) -> None:
        import redis

        super().__init__(capacity_bytes)
        if isinstance(url_or_client, str):
            self.client = redis.Redis.from_url(url_or_client)
        else:
            self.client = url_or_client
        self.fingerprint = fingerprint
        self.ttl_s = ttl_s
        self._rebuild_index()

    def _name(self, key: ChunkKey) -> str:
        return f"{NAMESPACE}:{self.fingerprint}:{quote(key.tenant, safe='')}:{{{key.digest}}}"

    def _rebuild_index(self) -> None:
        prefix = f"{NAMESPACE}:{self.fingerprint}:"
        for raw in self.client.scan_iter(match=prefix + "*", count=1000):
            name = raw.decode() if isinstance(raw, bytes) else raw
            tenant, _, tagged = name[len(prefix) :].rpartition(":")
            size = self.client.strlen(name)
            if tagged.startswith("{") and tagged.endswith("}") and size:
                self._index.set(ChunkKey(unquote(tenant), tagged[1:-1]), int(size))

    def put(self, key: ChunkKey, value: SessionKV) -> None:
        self.put_many([(key, value)])

    def put_many(self, items: list[tuple[ChunkKey, SessionKV]]) -> None:
        todo = [(k, v) for k, v in items if k not in self._index]
        if not todo:
            return
        needs = [self.check_fits(k, v) for k, v in todo]
        ttl = self.ttl_s if self.ttl_s > 0 else None
        with self.client.pipeline(transaction=False) as pipe:
            for key, value in todo:
                pipe.set(self._name(key), codec.encode(value, self.fingerprint), ex=ttl)
            pipe.execute()
        for (key, _), need in zip(todo, needs, strict=True):
            self._index.set(key, need)

    def get(self, key: ChunkKey) -> SessionKV | None:
        return self.get_many([key])[0]

    def get_many(self, keys: list[ChunkKey]) -> list[SessionKV | None]:
        with self.client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.get(self._name(key))
            raws = pipe.execute()
        out: list[SessionKV | None] = []
        for key, raw in zip(keys, raws, strict=True):
            if raw is None:
                self._index.pop(key)
                out.append(None)
                continue
            try:
                out.append(codec.decode(raw, self.fingerprint))
            except (codec.CorruptValueError, codec.FingerprintMismatch):
                self.delete(key)
                raise
        return out

    def delete(self, key: ChunkKey) -> bool:
        removed = bool(self.client.delete(self._name(key)))
        return self._index.pop(key) or removed

    def close(self) -> None:
        self.client.close()
