"""Remote tier: KV chunks in Redis, shared by replicas of the same model.

    chatstore:kv:<fingerprint>:<tenant>:{<digest>}   the encoded chunk (codec.py), with a TTL

One key per chunk; the hash tag `{<digest>}` pins everything of a chunk to one Redis Cluster
slot. Chunks are content-addressed, so a chunk another replica wrote is as good as our own, and
writing a key that exists changes nothing. Occupancy is this process's view of what it wrote
(rebuilt by SCAN at start), bounded by `capacity_bytes`. A chunk Redis expired or evicted reads
as a miss. `get_many` / `put_many` batch chunks in one pipeline.

Outages: every call goes through a CircuitBreaker (breaker.py) and, on a client made by
`connect_redis`, gives up after `timeout_s` without retrying. A failed or refused call raises
TierUnavailable (the hierarchy reads a miss, or writes elsewhere); while the breaker is open the
tier holds nothing as far as `contains` is concerned, and a delete only forgets the key here
(Redis expires it by TTL).

Redis Cluster: `connect_redis` returns a RedisCluster for a `redis+cluster://h:p,h:p` URL (or
`cluster=True`). Every call here names keys of one slot or goes through a non-transactional
pipeline, which RedisCluster splits per node; SCAN at start walks every master.

TLS and ACL: `rediss://` and `rediss+cluster://` URLs, a CA, a client certificate, an ACL user
and password (redis_security.py) apply to a single server and a cluster alike. The keys used
all start with `chatstore:`, so an ACL user limited to `~chatstore:*` is enough.

Threads: the client is thread-safe (a connection pool), the index is a FootprintIndex.

Encryption at rest: with a `sealer` every chunk is sealed under its tenant's key, (tenant,
digest) its associated data (sealing/sealer.py), so neither a dump nor Redis' memory holds KV
in the clear and a value copied under another key fails to open (dropped, a miss). The
sealed size is what STRLEN reports: the index at start counts it as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import quote, unquote

from chatstore.store.chunks import ChunkKey
from chatstore.store.sealing import KV_PURPOSE, OpenError, Sealer
from chatstore.store.session_kv import SessionKV
from chatstore.store.tiers import codec
from chatstore.store.tiers.base import IndexedTier, TierUnavailable
from chatstore.store.tiers.breaker import BreakerHealth, CircuitBreaker
from chatstore.store.tiers.redis_security import RedisSecurity

log = logging.getLogger(__name__)

NAMESPACE = "chatstore:kv"
T = TypeVar("T")


def is_cluster_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in ("redis+cluster", "rediss+cluster")


def cluster_startup_nodes(url: str) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """`redis+cluster://[user:pass@]h1:p1,h2:p2/…` (or a plain `redis://h:p`) -> the nodes to
    discover the topology from and the connection kwargs. urlsplit cannot parse a comma list of
    host:port pairs (`.port` raises), hence by hand; a database path is ignored (cluster: db 0)."""
    scheme, _, rest = url.partition("://")
    netloc = rest.split("/", 1)[0].split("?", 1)[0]
    userinfo, _, hosts = netloc.rpartition("@")
    kwargs: dict[str, Any] = {"ssl": scheme.lower().startswith("rediss")}
    if userinfo:
        user, _, password = userinfo.partition(":")
        kwargs["username"] = unquote(user) or None
        kwargs["password"] = unquote(password) or None
    nodes = []
    for part in filter(None, hosts.split(",")):
        host, colon, port = part.rpartition(":")
        if not colon or port.endswith("]"):  # no port: `host` or `[v6]`
            host, port = part, "6379"
        nodes.append((host.strip("[]"), int(port)))
    if not nodes:
        raise ValueError(f"no host:port in Redis Cluster URL {url!r}")
    return nodes, kwargs


def outage_errors() -> tuple[type[BaseException], ...]:
    """Errors meaning "Redis is out of reach", as opposed to an error reply. ClusterError covers
    CLUSTERDOWN / MASTERDOWN (a master lost, failover pending); RedisClusterException covers an
    uncovered slot and a topology no startup node could report."""
    from redis import exceptions as e

    return (e.ConnectionError, e.TimeoutError, OSError, e.ClusterError, e.RedisClusterException)


def connect_redis(
    url: str,
    timeout_s: float,
    cluster: bool = False,
    security: RedisSecurity | None = None,
) -> Any:
    """A client whose every call (connect included) gives up after timeout_s: redis-py otherwise
    retries a timed-out call up to 10 times with backoff, which turns a hung server into a
    multi-second stall per call. A cluster (`cluster`, or a `redis+cluster://` URL) gets one
    retry, taken after RedisCluster re-reads the topology, so a call that hit a failed-over
    master lands on its promoted replica; MOVED / ASK redirects it follows by itself.

    security: TLS files and ACL credentials (redis_security.py); its user and password win over
    the URL's. Nothing connects here: a wrong CA or password shows at the first call, as a
    ConnectionError (an outage to the breaker)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    extra = (security or RedisSecurity()).client_kwargs(url)
    if not (cluster or is_cluster_url(url)):
        return redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            **extra,
        )
    from redis.cluster import ClusterNode, RedisCluster

    nodes, kwargs = cluster_startup_nodes(url)
    return RedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in nodes],
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1),
        **{**kwargs, **extra},
    )


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
        try:
            self._call(self._rebuild_index)
        except TierUnavailable as exc:
            log.warning("remote tier unreachable at start (%s): its index starts empty", exc)

    def _name(self, key: ChunkKey) -> str:
        return f"{NAMESPACE}:{self.fingerprint}:{quote(key.tenant, safe='')}:{{{key.digest}}}"

    def _call(self, fn: Callable[[], T]) -> T:
        """fn() (socket I/O) through the breaker; TierUnavailable when refused or failed."""
        if not self.breaker.allow():
            raise TierUnavailable("remote tier: circuit open")
        try:
            out = fn()
        except self._outage as exc:
            self.breaker.failure(exc)
            raise TierUnavailable(f"remote tier: {exc}") from exc
        except BaseException:
            self.breaker.success()  # the server answered (an error reply, not an outage)
            raise
        self.breaker.success()
        return out

    def _rebuild_index(self) -> None:
        prefix = f"{NAMESPACE}:{self.fingerprint}:"
        for raw in self.client.scan_iter(match=prefix + "*", count=1000):
            name = raw.decode() if isinstance(raw, bytes) else raw
            tenant, _, tagged = name[len(prefix) :].rpartition(":")
            size = self.client.strlen(name)
            if tagged.startswith("{") and tagged.endswith("}") and size:
                self._index.set(ChunkKey(unquote(tenant), tagged[1:-1]), int(size))

    def contains(self, key: ChunkKey) -> bool:
        # No I/O: the index, unless the breaker says the server is out (then absent).
        return key in self._index and not self.breaker.is_open()

    def put(self, key: ChunkKey, value: SessionKV) -> None:
        self.put_many([(key, value)])

    def put_many(self, items: list[tuple[ChunkKey, SessionKV]]) -> None:
        todo = [(k, v) for k, v in items if k not in self._index]
        if not todo:
            return
        needs = [self.check_fits(k, v) for k, v in todo]
        ttl = self.ttl_s if self.ttl_s > 0 else None
        blobs = [(self._name(k), self._seal(k, codec.encode(v, self.fingerprint))) for k, v in todo]

        def write() -> None:
            with self.client.pipeline(transaction=False) as pipe:
                for name, blob in blobs:
                    pipe.set(name, blob, ex=ttl)
                pipe.execute()

        self._call(write)
        for (key, _), need in zip(todo, needs, strict=True):
            self._index.set(key, need)

    def get(self, key: ChunkKey) -> SessionKV | None:
        return self.get_many([key])[0]

    def get_many(self, keys: list[ChunkKey]) -> list[SessionKV | None]:
        """The chunks (None: Redis no longer has it); TierUnavailable when out of reach."""

        def read() -> list[Any]:
            with self.client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.get(self._name(key))
                return pipe.execute()

        raws = self._call(read)
        out: list[SessionKV | None] = []
        for key, raw in zip(keys, raws, strict=True):
            if raw is None:
                self._index.pop(key)
                out.append(None)
                continue
            try:
                out.append(self._decode(key, raw))
            except (codec.CorruptValueError, codec.FingerprintMismatch):
                self.delete(key)
                raise
        return out

    def _seal(self, key: ChunkKey, blob: bytearray) -> bytes | bytearray:
        if self.sealer is None:
            return blob
        return self.sealer.seal(KV_PURPOSE, key.tenant, key.digest.encode(), blob)

    def _decode(self, key: ChunkKey, raw: bytes) -> SessionKV:
        if self.sealer is not None:
            raw = self.sealer.open(KV_PURPOSE, key.tenant, key.digest.encode(), raw)
        return codec.decode(raw, self.fingerprint)

    def reseal(self, key: ChunkKey) -> bool:
        """Re-seal key's chunk under the sealing key if it is under an older one or in the
        clear (key rotation); whether it was rewritten. Its TTL is kept, and a chunk that
        expired meanwhile is not written back (SET XX KEEPTTL); one that opens under no key is
        deleted. TierUnavailable when Redis is out of reach."""
        sealer = self.sealer
        if sealer is None:
            return False
        name = self._name(key)
        raw = self._call(lambda: self.client.get(name))
        if raw is None or not sealer.needs_reseal(raw):
            return False
        try:
            plain = sealer.open(KV_PURPOSE, key.tenant, key.digest.encode(), raw)
        except OpenError:
            plain = raw if raw.startswith(codec.MAGIC) else b""
        try:
            codec.decode(plain, self.fingerprint)  # beneath the seal: checksum and model
        except (codec.CorruptValueError, codec.FingerprintMismatch):
            self.delete(key)
            return False
        sealed = sealer.seal(KV_PURPOSE, key.tenant, key.digest.encode(), plain)
        return bool(self._call(lambda: self.client.set(name, sealed, xx=True, keepttl=True)))

    def delete(self, key: ChunkKey) -> bool:
        known = self._index.pop(key)
        try:
            removed = bool(self._call(lambda: self.client.delete(self._name(key))))
        except TierUnavailable:
            removed = False  # out of reach: Redis expires it by TTL
        return known or removed

    def discover(self, keys: list[ChunkKey]) -> int:
        """Learn which of keys another replica stored since our index was built (one
        pipelined STRLEN round); how many were found. Not for the engine's thread."""
        todo = [k for k in keys if k not in self._index]
        if not todo:
            return 0

        def probe() -> list[Any]:
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
