"""The store's parts built from its settings: the sealer and the Redis client they share, the
tiers (DRAM, LMDB, Redis), the session records; and its stats, read from the tiers."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from chatstore.store.events import StoreStats
from chatstore.store.records.base import RecordStore
from chatstore.store.records.lmdb import LmdbRecordStore
from chatstore.store.records.redis import RedisRecordStore
from chatstore.store.sealing import KeyStore, Sealer, sealer_for
from chatstore.store.sealing.key_store_lmdb import FILE_NAME as KEYS_FILE
from chatstore.store.sealing.key_store_lmdb import LmdbKeyStore
from chatstore.store.sealing.key_store_redis import RedisKeyStore
from chatstore.store.sealing.key_watch import KeyWatch
from chatstore.store.settings import StoreSettings
from chatstore.store.tiers.base import StorageTier
from chatstore.store.tiers.breaker import CircuitBreaker
from chatstore.store.tiers.chunk_tiers import ChunkTiers
from chatstore.store.tiers.dram import DramTier, TokenKVShape
from chatstore.store.tiers.lmdb import LmdbTier
from chatstore.store.tiers.redis import RedisTier, connect_redis

log = logging.getLogger(__name__)

EVICTING = ("allkeys-", "volatile-")  # maxmemory-policy prefixes that evict keys


@dataclass(frozen=True)
class RemoteParts:
    """One sealer for the records and the slow tiers (DRAM stays in the clear), its data keys
    in the records' key store (their Redis, watched for other replicas' changes, or LMDB);
    the KV Redis client and breaker; and where records live (records_url): the same client
    (they fail and recover together), a Redis of their own (`records_client`, its own
    breaker), or LMDB."""

    sealer: Sealer | None
    client: Any  # the KV tier's Redis client, or None without Redis
    breaker: CircuitBreaker
    key_watch: KeyWatch | None
    records_client: Any = None  # the records' Redis (leases, shreds too), or None: LMDB
    records_breaker: CircuitBreaker | None = None


def records_backend(settings: StoreSettings) -> str:
    """Where records go: "kv-redis" (records_url "" with redis_url set: as before), "lmdb"
    (records_url "lmdb", or neither URL set), or "redis" (records_url a Redis URL)."""
    url = settings.records_url
    if url == "lmdb" or (not url and not settings.redis_url):
        return "lmdb"
    return "redis" if url else "kv-redis"


def warn_if_evicting(client: Any, what: str) -> str | None:
    """Log a warning when the Redis holding records evicts keys under memory pressure (its
    maxmemory-policy, from INFO memory: the ACL of deploy/redis-users.acl.template allows it,
    CONFIG GET would also show passwords); the policy, or None where INFO is refused."""
    try:
        info = client.info("memory")
    except Exception as exc:  # an ACL without +info, a managed Redis, an outage
        log.info("%s: maxmemory-policy not readable (%s): make sure it is noeviction", what, exc)
        return None
    if isinstance(info, dict) and "maxmemory_policy" not in info and info:
        info = next(iter(info.values()))  # a cluster: {node: {...}}
    policy = str(info.get("maxmemory_policy", "")) if isinstance(info, dict) else ""
    if policy.startswith(EVICTING):
        log.warning(
            "%s: session records are in a Redis whose maxmemory-policy is %s: under memory "
            "pressure it may evict records (acknowledged turns lost) and the tenants' data "
            "keys (everything sealed under them lost). Give records a Redis of "
            "their own with noeviction and AOF (records_url), or records_url = \"lmdb\" on "
            "a single node.",
            what, policy,
        )  # fmt: skip
    return policy or None


def build_remote(settings: StoreSettings, redis_client: Any = None) -> RemoteParts:
    remote = redis_client
    if remote is None and settings.redis_url:
        # Every call gives up after the timeout, so a hung Redis costs a bounded wait (and
        # the tier's breaker, less).
        remote = connect_redis(
            settings.redis_url,
            settings.redis_timeout_s,
            cluster=settings.redis_cluster,
            security=settings.redis_security,
        )
    breaker = CircuitBreaker(settings.redis_breaker_failures, settings.redis_breaker_reset_s)
    backend = records_backend(settings)
    records, records_breaker = None, None
    if backend == "kv-redis" and remote is not None:
        records, records_breaker = remote, breaker
        warn_if_evicting(remote, "redis_url")
    elif backend == "redis":
        records = connect_redis(
            settings.records_url,
            settings.redis_timeout_s,
            cluster=settings.redis_cluster,
            security=settings.redis_security,
        )
        records_breaker = CircuitBreaker(
            settings.redis_breaker_failures, settings.redis_breaker_reset_s
        )
        warn_if_evicting(records, "records_url")
    # The data keys live with the records: in their Redis, shared by the replicas (a change
    # another replica makes is seen through the key store's epoch), else in LMDB beside them.
    sealer = build_sealer(settings, records)
    watch = KeyWatch(sealer.keyring) if sealer is not None and records is not None else None
    return RemoteParts(sealer, remote, breaker, watch, records, records_breaker)


def build_sealer(settings: StoreSettings, redis_keys: Any = None) -> Sealer | None:
    """The sealer (None: encryption at rest off); its data keys in the Redis client
    redis_keys, else in LMDB in the data directory."""
    s = settings
    replicas = bool(s.redis_url or s.records_url not in ("", "lmdb"))

    def key_store() -> KeyStore:
        if redis_keys is not None:
            return RedisKeyStore(redis_keys)
        return LmdbKeyStore(s.data_dir / KEYS_FILE)

    return sealer_for(
        s.encrypt_at_rest, s.data_dir, key_store, s.secret_key, s.secret_key_file, replicas
    )


def build_tiers(
    settings: StoreSettings, layout: TokenKVShape, fingerprint: str, remote: RemoteParts
) -> list[StorageTier]:
    s = settings
    tiers: list[StorageTier] = []
    if s.dram_bytes > 0:
        tiers.append(DramTier(s.dram_bytes, layout, s.block_size))
    if s.ssd_bytes > 0:
        path = s.data_dir / "kv.lmdb"
        tiers.append(LmdbTier(path, s.ssd_bytes, fingerprint, sealer=remote.sealer))
    if remote.client is not None and s.redis_bytes > 0:
        log.info(
            "shared KV tier in Redis: its maxmemory-policy evicts (deploy/redis-kv.conf: "
            "allkeys-lru), no replica deletes there; redis_bytes (%d) is only reported",
            s.redis_bytes,
        )
        ttl, timeout = s.session_ttl_s, s.redis_timeout_s
        tiers.append(
            RedisTier(
                remote.client, s.redis_bytes, fingerprint, ttl, timeout, remote.breaker,
                remote.sealer,
            )
        )  # fmt: skip
    return tiers


def build_records(settings: StoreSettings, remote: RemoteParts) -> RecordStore:
    s = settings
    if remote.records_client is not None:
        return RedisRecordStore(
            remote.records_client, s.session_ttl_s, s.redis_timeout_s, remote.records_breaker,
            remote.sealer,
        )  # fmt: skip
    return LmdbRecordStore(
        s.data_dir / "records.lmdb", s.session_ttl_s, map_size=s.records_map_bytes,
        sealer=remote.sealer,
    )  # fmt: skip


def store_stats(tiers: ChunkTiers, breaker: CircuitBreaker | None) -> StoreStats:
    with tiers.lock:
        c = tiers.counters
        counters = replace(c, tiers={n: t.copy() for n, t in c.tiers.items()})
    health = breaker.health() if breaker is not None else None
    return StoreStats(tiers.stats_occupancy(), counters, tiers.tiers[0].name, health)


def build_records_only(settings: StoreSettings) -> RecordStore:
    """kv_store = "off" (every turn recomputes): the session records still need a home, in
    LMDB under data_dir (no Redis: no KV to share), sealed as the store would seal them."""
    s = settings
    sealer = build_sealer(s)
    return LmdbRecordStore(
        s.data_dir / "records.lmdb", s.session_ttl_s, map_size=s.records_map_bytes, sealer=sealer
    )
