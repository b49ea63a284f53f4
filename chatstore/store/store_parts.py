"""The store's parts built from its settings: the sealer and the Redis client they share, the
tiers (DRAM, LMDB, Redis), the session records; and its stats, read from the tiers."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from chatstore.store.events import StoreStats
from chatstore.store.records import LmdbRecordStore, RecordStore, RedisRecordStore
from chatstore.store.sealing import Sealer, sealer_for
from chatstore.store.sealing.shared_shreds import SharedShreds
from chatstore.store.settings import StoreSettings
from chatstore.store.tiers.base import StorageTier
from chatstore.store.tiers.breaker import CircuitBreaker
from chatstore.store.tiers.chunk_tiers import ChunkTiers
from chatstore.store.tiers.dram import DramTier, KVLayout
from chatstore.store.tiers.lmdb import LmdbTier
from chatstore.store.tiers.redis import RedisTier, connect_redis


@dataclass(frozen=True)
class RemoteParts:
    """One sealer for the records and the slow tiers (DRAM stays in the clear), and one Redis
    client and breaker for the KV tier and the records: they fail (and recover) together."""

    sealer: Sealer | None
    client: Any  # a Redis client, or None without Redis
    breaker: CircuitBreaker
    shared_shreds: SharedShreds | None


def build_remote(settings: StoreSettings, redis_client: Any = None) -> RemoteParts:
    sealer = sealer_for(
        settings.encrypt_at_rest, settings.data_dir, settings.secret_key, settings.secret_key_file
    )
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
    # Replicas share the shred list in Redis as they share the secret (shared_shreds.py).
    shreds = (
        SharedShreds(remote, sealer.keyring) if remote is not None and sealer is not None else None
    )
    breaker = CircuitBreaker(settings.redis_breaker_failures, settings.redis_breaker_reset_s)
    return RemoteParts(sealer, remote, breaker, shreds)


def build_tiers(
    settings: StoreSettings, layout: KVLayout, fingerprint: str, remote: RemoteParts
) -> list[StorageTier]:
    s = settings
    tiers: list[StorageTier] = []
    if s.dram_bytes > 0:
        tiers.append(DramTier(s.dram_bytes, layout, s.block_size))
    if s.ssd_bytes > 0:
        path = s.data_dir / "kv.lmdb"
        tiers.append(LmdbTier(path, s.ssd_bytes, fingerprint, sealer=remote.sealer))
    if remote.client is not None and s.redis_bytes > 0:
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
    if remote.client is not None:
        return RedisRecordStore(
            remote.client, s.session_ttl_s, s.redis_timeout_s, remote.breaker, remote.sealer
        )
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
    sealer = sealer_for(s.encrypt_at_rest, s.data_dir, s.secret_key, s.secret_key_file)
    return LmdbRecordStore(
        s.data_dir / "records.lmdb", s.session_ttl_s, map_size=s.records_map_bytes, sealer=sealer
    )
