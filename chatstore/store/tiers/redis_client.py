"""Connecting to Redis: a single server or a Redis Cluster, clients that give up after
`timeout_s` instead of retrying, and which errors mean Redis is out of reach. The KV tier
(redis.py) and the session records (records/redis.py) connect through `connect_redis`.

Redis Cluster: `connect_redis` returns a RedisCluster for a `redis+cluster://h:p,h:p` URL (or
`cluster=True`); its callers name keys of one slot or use non-transactional pipelines, which
RedisCluster splits per node.

TLS and ACL: `rediss://` and `rediss+cluster://` URLs, a CA, a client certificate, an ACL user
and password (redis_security.py) apply to a single server and a cluster alike.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

from chatstore.redis_security import RedisSecurity


def is_cluster_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in ("redis+cluster", "rediss+cluster")


def cluster_startup_nodes(
    url: str,
) -> tuple[list[tuple[str, int]], dict[str, str | bool | None]]:
    """`redis+cluster://[user:pass@]h1:p1,h2:p2/…` (or a plain `redis://h:p`) -> the nodes to
    discover the topology from and the connection kwargs. urlsplit cannot parse a comma list of
    host:port pairs (`.port` raises), hence by hand; a database path is ignored (cluster: db 0)."""
    scheme, _, rest = url.partition("://")
    netloc = rest.split("/", 1)[0].split("?", 1)[0]
    userinfo, _, hosts = netloc.rpartition("@")
    kwargs: dict[str, str | bool | None] = {"ssl": scheme.lower().startswith("rediss")}
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


def out_of_memory(exc: BaseException) -> bool:
    """Redis refused a write for memory (OOM: maxmemory reached with noeviction)."""
    from redis import exceptions as e

    oom = getattr(e, "OutOfMemoryError", ())
    return (bool(oom) and isinstance(exc, oom)) or "maxmemory" in str(exc)


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
