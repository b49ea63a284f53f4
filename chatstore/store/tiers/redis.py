"""Remote tier: KV chunks in Redis, shared by replicas of the same model.

    chatstore:kv:<fingerprint>:<tenant>:{<digest>}   the encoded chunk (codec.py), with a TTL

One key per chunk; the hash tag `{<digest>}` pins everything of a chunk to one Redis Cluster
slot. Chunks are content-addressed, so a chunk another replica wrote is as good as our own.

One owner of eviction: Redis. No replica deletes a shared chunk: Redis's own `maxmemory`
policy (allkeys-lru, deploy/redis-kv.conf) evicts, and its TTL expires what nobody reads. Every
read refreshes a chunk's TTL (GETEX … EX) and so does a put of a chunk that is there already
(EXPIRE, and a SET only if Redis had evicted it), so a hot shared system prompt stays while it
is used. `delete` forgets the key here and sends nothing; only `delete_shared` (a crypto-shredded
tenant, an explicit shared flush) removes keys from Redis. A value a replica cannot open, or
finds corrupt, is a miss there and stays: another replica (with another key, or mid-rotation)
may open it, and Redis's eviction and TTL remove what nobody reads.

The index is this process's view of which chunks Redis holds (written or read here, or found
by `discover`): no SCAN at start, no round trip per key. A chunk Redis evicted reads as a miss
(the caller recomputes). `capacity_bytes` (redis_bytes) is a planning number shown as the tier's
capacity: a put never makes room here, and `used_bytes` (the bytes this replica knows of) may
pass it. `get_many` / `put_many` batch chunks in one pipeline.

Outages: every call goes through a CircuitBreaker (breaker.py) and, on a client made by
`connect_redis`, gives up after `timeout_s` without retrying. A failed or refused call raises
TierUnavailable (the hierarchy reads a miss, or writes elsewhere); while the breaker is open the
tier holds nothing as far as `contains` is concerned. A write Redis refuses for memory (OOM:
maxmemory with noeviction) raises TierFull.

Redis Cluster: `connect_redis` (redis_client.py) returns a RedisCluster for a
`redis+cluster://h:p,h:p` URL (or `cluster=True`). Every call here names keys of one slot or
goes through a non-transactional pipeline, which RedisCluster splits per node; a SCAN (shared
flush, shred) walks every master. TLS and ACL: redis_client.py. The keys used all start with
`chatstore:`, so an ACL user limited to `~chatstore:*` is enough.

Threads: the client is thread-safe (a connection pool), the index is a FootprintIndex.

Encryption at rest: with a `sealer` every chunk is sealed under its tenant's data key, (tenant,
digest) its associated data (sealing/sealer.py), so neither a dump nor Redis' memory holds KV
in the clear and a value copied under another key fails to open (a miss, left in place).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import quote, unquote

from chatstore.store.sealing import KV_PURPOSE, Sealer
from chatstore.store.sealing.sealer import is_sealed
from chatstore.store.session_kv import ChunkKey, SessionKV
from chatstore.store.tiers import codec
from chatstore.store.tiers.base import IndexedTier, TierFull, TierUnavailable
from chatstore.store.tiers.breaker import BreakerHealth, CircuitBreaker
from chatstore.store.tiers.redis_client import connect_redis, out_of_memory, outage_errors

log = logging.getLogger(__name__)

NAMESPACE = "chatstore:kv"
T = TypeVar("T")


class RedisTier(IndexedTier):
    name = "remote"
    remote = True

    def __init__(
        self,
        url_or_client: str | Any,
        capacity_bytes: int,
        fingerprint: str,
        ttl_s: int = 86400,
        timeout_s: float = 0.25,
        breaker: CircuitBreaker | None = None,
        sealer: Sealer | None = None,
    ) -> None:
        super().__init__(capacity_bytes)
        self.sealer = sealer
        if isinstance(url_or_client, str):
            self.client = connect_redis(url_or_client, timeout_s)
        else:
            self.client = url_or_client
        self.fingerprint = fingerprint
        self.ttl_s = ttl_s
        self.breaker = breaker or CircuitBreaker()
        self._outage = outage_errors()

    def _name(self, key: ChunkKey) -> str:
        return f"{NAMESPACE}:{self.fingerprint}:{quote(key.tenant, safe='')}:{{{key.digest}}}"

    def _call(self, fn: Callable[[], T]) -> T:
        """fn() (socket I/O) through the breaker; TierUnavailable when refused or failed,
        TierFull when Redis refused a write for memory (OOM)."""
        if not self.breaker.allow():
            raise TierUnavailable("remote tier: circuit open")
        try:
            out = fn()
        except self._outage as exc:
            self.breaker.failure(exc)
            raise TierUnavailable(f"remote tier: {exc}") from exc
        except BaseException as exc:
            self.breaker.success()  # the server answered (an error reply, not an outage)
            if out_of_memory(exc):
                raise TierFull(f"remote tier: {exc}") from exc
            raise
        self.breaker.success()
        return out

    def contains(self, key: ChunkKey) -> bool:
        # No I/O: the index, unless the breaker says the server is out (then absent).
        return key in self._index and not self.breaker.is_open()

    def check_fits(self, key: ChunkKey, value: SessionKV) -> int:
        return self.footprint(value)  # Redis makes room (maxmemory policy), not us

    def can_put(self, value: SessionKV) -> bool:
        return True

    def put(self, key: ChunkKey, value: SessionKV) -> None:
        self.put_many([(key, value)])

    def put_many(self, items: list[tuple[ChunkKey, SessionKV]]) -> None:
        """Store the chunks with a fresh TTL: one Redis has already (as far as we know) gets
        an EXPIRE, and is written only if Redis had evicted it meanwhile."""
        ttl = self.ttl_s if self.ttl_s > 0 else None
        known = [(k, v) for k, v in items if k in self._index]
        todo = [(k, v) for k, v in items if k not in self._index]
        if known:
            alive = self._call(lambda: self._expire([k for k, _ in known]))
            todo += [item for item, ok in zip(known, alive, strict=True) if not ok]
        if not todo:
            return
        needs = [self.footprint(v) for _, v in todo]
        blobs = [(self._name(k), self._encoded(k, v)) for k, v in todo]

        def write() -> None:
            with self.client.pipeline(transaction=False) as pipe:
                for name, blob in blobs:
                    pipe.set(name, blob, ex=ttl)
                pipe.execute()

        self._call(write)
        for (key, _), need in zip(todo, needs, strict=True):
            self._index.set(key, need)

    def _expire(self, keys: list[ChunkKey]) -> list[bool]:
        """Refresh keys' TTL (PERSIST-free: without a TTL, EXISTS); whether each is there."""
        with self.client.pipeline(transaction=False) as pipe:
            for key in keys:
                if self.ttl_s > 0:
                    pipe.expire(self._name(key), self.ttl_s)
                else:
                    pipe.exists(self._name(key))
            return [bool(r) for r in pipe.execute()]

    def refresh(self, keys: list[ChunkKey]) -> int:
        """Refresh the TTL of keys Redis holds (a use that read no value); how many are
        there. One Redis evicted is forgotten here (a miss)."""
        if not keys:
            return 0
        alive = self._call(lambda: self._expire(keys))
        for key, ok in zip(keys, alive, strict=True):
            if not ok:
                self._index.pop(key)
        return sum(alive)

    def get(self, key: ChunkKey) -> SessionKV | None:
        return self.get_many([key])[0]

    def get_many(self, keys: list[ChunkKey]) -> list[SessionKV | None]:
        """The chunks (None: Redis no longer has it); TierUnavailable when out of reach."""

        ttl = self.ttl_s if self.ttl_s > 0 else None

        def read() -> list[bytes | None]:  # GETEX: every read refreshes the chunk's TTL
            with self.client.pipeline(transaction=False) as pipe:
                for key in keys:
                    if ttl is None:
                        pipe.get(self._name(key))
                    else:
                        pipe.getex(self._name(key), ex=ttl)
                return pipe.execute()

        raws = self._call(read)
        out: list[SessionKV | None] = []
        for key, raw in zip(keys, raws, strict=True):
            if raw is None:
                self._index.pop(key)
                out.append(None)
                continue
            # A value that does not open, or fails its checks, raises (the reader counts a
            # miss) and stays in Redis: another replica's key may open it, and Redis's own
            # eviction and TTL remove what nobody reads. No replica deletes it on a read;
            # this one forgets it (no read of it again, until found anew).
            try:
                out.append(self._decode(key, raw))
            except (codec.CorruptValueError, codec.FingerprintMismatch):
                self._index.pop(key)
                raise
            self._index.set(key, self._index.size_of(key) or len(raw))
        return out

    def _encoded(self, key: ChunkKey, value: SessionKV) -> bytearray:
        """The value as stored: sealed straight from its KV's memory (the tag its checksum),
        or in the clear with its crc32."""
        if self.sealer is None:
            return codec.encode(value, self.fingerprint)
        parts = codec.sealable_parts(value, self.fingerprint)
        return self.sealer.seal_parts(KV_PURPOSE, key.tenant, key.digest.encode(), parts)

    def _decode(self, key: ChunkKey, raw: bytes) -> SessionKV:
        if self.sealer is None:
            return codec.decode(raw, self.fingerprint)
        # Opened into a buffer of its own, in which the chunk's KV stays (no second copy).
        plain = self.sealer.open_owned(KV_PURPOSE, key.tenant, key.digest.encode(), raw)
        return codec.decode_owned(plain, self.fingerprint, authenticated=True)

    def reseal(self, key: ChunkKey, adopt_clear: bool = False) -> bool:
        """Re-seal key's chunk under its tenant's sealing data key if it is under an older one
        (data-key rotation); whether it was rewritten. Its TTL is kept, and a chunk that
        expired meanwhile is not written back (SET XX KEEPTTL). A value that does not open is
        left as it is (another replica's key may open it). A clear value is sealed only with
        adopt_clear (encrypt-existing), and only if it is a valid chunk of this model.
        TierUnavailable when Redis is out of reach."""
        sealer = self.sealer
        if sealer is None:
            return False
        name = self._name(key)
        raw = self._call(lambda: self.client.get(name))
        if raw is None or is_sealed(raw) == adopt_clear:
            return False
        if not adopt_clear and not sealer.needs_reseal(key.tenant, raw):
            return False
        try:
            plain = (
                raw
                if adopt_clear
                else sealer.open(KV_PURPOSE, key.tenant, key.digest.encode(), raw)
            )
            # Its checksum (a clear value being adopted) or tag (opened), and its model.
            codec.decode(plain, self.fingerprint, authenticated=not adopt_clear)
        except (codec.CorruptValueError, codec.FingerprintMismatch):
            return False
        sealed = sealer.seal(KV_PURPOSE, key.tenant, key.digest.encode(), plain)
        return bool(self._call(lambda: self.client.set(name, sealed, xx=True, keepttl=True)))

    def delete(self, key: ChunkKey) -> bool:
        """Forget key here; Redis keeps it (another replica may use it: Redis's maxmemory
        policy and the TTL decide when it goes). Whether it was known."""
        return self._index.pop(key)

    def delete_shared(self, key: ChunkKey) -> bool:
        """Remove key from Redis itself (a shredded tenant); whether it was stored. Not for a
        chunk this replica merely stopped using, nor one it could not open."""
        known = self._index.pop(key)
        try:
            removed = bool(self._call(lambda: self.client.delete(self._name(key))))
        except TierUnavailable:
            removed = False  # out of reach: Redis expires it by TTL
        return known or removed

    def clear_shared(self, tenant: str | None = None) -> int:
        """Remove every chunk of this model (of one tenant) from Redis, for every replica: an
        explicit shared flush or a tenant's shred. A SCAN of the model's keys (every master
        of a cluster), UNLINK in batches; how many keys went."""
        self._index.clear()
        match = f"{NAMESPACE}:{self.fingerprint}:"
        match += f"{quote(tenant, safe='')}:*" if tenant is not None else "*"

        def unlink_all() -> int:
            removed, batch = 0, []
            for raw in self.client.scan_iter(match=match, count=1000):
                batch.append(raw)
                if len(batch) >= 500:
                    removed += self._unlink(batch)
                    batch = []
            return removed + (self._unlink(batch) if batch else 0)

        return self._call(unlink_all)

    def stored_keys(self) -> list[ChunkKey]:
        """Every chunk of this model in Redis, whoever wrote it: a SCAN of the model's keys
        (every master of a cluster), for a background job (key rotation), never a turn."""
        prefix = f"{NAMESPACE}:{self.fingerprint}:"

        def scan() -> list[ChunkKey]:
            out = []
            for raw in self.client.scan_iter(match=prefix + "*", count=1000):
                name = raw.decode() if isinstance(raw, bytes) else raw
                tenant, _, tagged = name[len(prefix) :].rpartition(":")
                if tagged.startswith("{") and tagged.endswith("}"):
                    out.append(ChunkKey(unquote(tenant), tagged[1:-1]))
            return out

        return self._call(scan)

    def _unlink(self, names: list[bytes | str]) -> int:
        with self.client.pipeline(transaction=False) as pipe:
            for name in names:  # one key a command: a cluster splits the pipeline by node
                pipe.unlink(name)
            return sum(int(r) for r in pipe.execute())

    def discover(self, keys: list[ChunkKey]) -> int:
        """Learn which of keys another replica stored since our index was built (one
        pipelined STRLEN round); how many were found. Not for the engine's thread."""
        todo = [k for k in keys if k not in self._index]
        if not todo:
            return 0

        def probe() -> list[int]:
            with self.client.pipeline(transaction=False) as pipe:
                for key in todo:
                    pipe.strlen(self._name(key))
                return pipe.execute()

        found = 0
        for key, size in zip(todo, self._call(probe), strict=True):
            if size:
                self._index.set(key, int(size))
                found += 1
        return found

    def health(self) -> BreakerHealth:
        return self.breaker.health()

    def close(self) -> None:
        self.client.close()
