"""AttentionStore: session KV across turns in DRAM -> LMDB -> Redis, plus durable records.

Built from config by `create_store` (None when `kv_store = "off"`). Everything on disk lives
under `data_dir`:

    <data_dir>/kv.lmdb        SSD tier (session KV; remembers the model fingerprint)
    <data_dir>/records.lmdb   session records (when no Redis is configured)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from chatstore.config import DTYPES, Config
from chatstore.model.spec import ModelSpec
from chatstore.store.decoupled import plan_truncation
from chatstore.store.dram_tier import DramTier, KVLayout
from chatstore.store.events import EventLog, Listener, StoreStats
from chatstore.store.hierarchy import TierHierarchy
from chatstore.store.lmdb_tier import LmdbTier
from chatstore.store.records import LmdbRecordStore, RecordStore, RedisRecordStore
from chatstore.store.redis_tier import RedisTier
from chatstore.store.session_kv import SessionKey, SessionKV, common_prefix_len
from chatstore.store.tier import StorageTier, TierOccupancy
from chatstore.store.victims import VictimChooser


def default_data_dir() -> Path:
    from chatstore.model.default_model import chatstore_home

    return chatstore_home() / "data"


@dataclass(frozen=True)
class StoreSettings:
    data_dir: Path
    dram_bytes: int = 4 << 30
    ssd_bytes: int = 32 << 30
    redis_url: str = ""
    redis_bytes: int = 4 << 30
    storage_dtype: torch.dtype = torch.float32
    session_ttl_s: int = 86400
    max_context_tokens: int = 8192
    truncation_ratio: float = 0.5
    block_size: int = 16

    @classmethod
    def from_config(cls, config: Config) -> StoreSettings:
        data_dir = config.data_dir or os.environ.get("CHATSTORE_DATA_DIR", "")
        return cls(
            data_dir=Path(data_dir).expanduser() if data_dir else default_data_dir(),
            dram_bytes=config.dram_bytes,
            ssd_bytes=config.ssd_bytes,
            redis_url=config.redis_url,
            redis_bytes=config.redis_bytes,
            storage_dtype=DTYPES[config.kv_storage_dtype],
            session_ttl_s=config.session_ttl_s,
            max_context_tokens=config.max_context_tokens,
            truncation_ratio=config.truncation_ratio,
            block_size=config.block_size,
        )


class AttentionStore:
    def __init__(
        self,
        settings: StoreSettings,
        spec: ModelSpec,
        fingerprint: str,
        chooser: VictimChooser | None = None,
        redis_client: Any = None,
    ) -> None:
        self.settings = settings
        self.fingerprint = fingerprint
        self.layout = KVLayout(
            spec.num_layers, spec.num_kv_heads, spec.head_dim, settings.storage_dtype
        )
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        remote = redis_client if redis_client is not None else settings.redis_url
        tiers: list[StorageTier] = []
        if settings.dram_bytes > 0:
            tiers.append(DramTier(settings.dram_bytes, self.layout, settings.block_size))
        if settings.ssd_bytes > 0:
            tiers.append(LmdbTier(settings.data_dir / "kv.lmdb", settings.ssd_bytes, fingerprint))
        if remote and settings.redis_bytes > 0:
            tiers.append(
                RedisTier(remote, settings.redis_bytes, fingerprint, settings.session_ttl_s)
            )
        self.events = EventLog()
        self.hierarchy = TierHierarchy(tiers, chooser, self.events)
        self.records: RecordStore = (
            RedisRecordStore(remote, settings.session_ttl_s)
            if remote
            else LmdbRecordStore(settings.data_dir / "records.lmdb", settings.session_ttl_s)
        )

    @staticmethod
    def key(tenant: str, session_id: str) -> SessionKey:
        return SessionKey(tenant, session_id)

    def tier(self, name: str) -> StorageTier | None:
        return next((t for t in self.hierarchy.tiers if t.name == name), None)

    def lookup(self, tenant: str, session_id: str) -> SessionKV | None:
        """The session's saved KV (moved up to DRAM), or None; an expired session is forgotten."""
        key = self.key(tenant, session_id)
        record = self.records._load(key)
        if record is not None and self.records.expired(record):
            self.delete_session(tenant, session_id)
            return None
        return self.hierarchy.get(key)

    def save(self, tenant: str, session_id: str, value: SessionKV) -> str | None:
        """Keep value as the session's KV (whole turn at once); the tier it landed in."""
        key = self.key(tenant, session_id)
        value = value.to(self.settings.storage_dtype)
        landed = self.hierarchy.put(key, value)
        self.records.upsert(key, token_ids=list(value.token_ids) if landed else [])
        return landed

    def saved_tokens(self, tenant: str, session_id: str) -> list[int]:
        record = self.records.get(self.key(tenant, session_id))
        return list(record.token_ids) if record else []

    def delete_session(self, tenant: str, session_id: str) -> bool:
        """Remove the session's KV from every tier and its record."""
        key = self.key(tenant, session_id)
        found = self.hierarchy.delete(key)
        return self.records.delete(key) or found

    def purge_expired(self) -> list[SessionKey]:
        gone = self.records.purge_expired()
        for key in gone:
            self.hierarchy.delete(key)
        return gone

    def invalidate_all(self) -> None:
        self.hierarchy.clear()

    def fit_context(
        self, tenant: str, session_id: str | None, prompt_ids: list[int], head: int, tail: int
    ) -> list[int]:
        """The prompt cut to `max_context_tokens` (oldest history after the first `head` tokens
        dropped; `tail` = new message + reply budget kept), the session's saved KV cut the same
        way so the next load reuses it at its new positions."""
        s = self.settings
        plan = plan_truncation(
            len(prompt_ids), head, tail, s.max_context_tokens, s.truncation_ratio
        )
        if plan is None:
            return list(prompt_ids)
        if session_id is not None:
            value = self.lookup(tenant, session_id)
            if value is not None:
                kept = value.prefix(common_prefix_len(value.token_ids, prompt_ids))
                self.save(tenant, session_id, plan.apply_kv(kept))
        return plan.apply_ids(prompt_ids)

    def set_device_occupancy(self, provider: Any) -> None:
        """A callable returning the engine pool's TierOccupancy, shown first in stats()."""
        self.hierarchy.device_occupancy = provider

    def stats(self) -> StoreStats:
        return self.hierarchy.stats()

    def add_listener(self, listener: Listener) -> None:
        self.events.add_listener(listener)

    def close(self, flush_dram: bool = True) -> None:
        """Graceful shutdown: DRAM sessions move to LMDB (so a restart finds them), then close."""
        if flush_dram and len(self.hierarchy.tiers) > 1 and self.tier("dram") is not None:
            self.hierarchy.demote_all(0)
        for tier in self.hierarchy.tiers:
            tier.close()
        self.records.close()


def create_store(
    config: Config, spec: ModelSpec, fingerprint: str, **kwargs: Any
) -> AttentionStore | None:
    """The store for this config, or None when `kv_store = "off"` (the recompute baseline)."""
    if config.kv_store == "off":
        return None
    return AttentionStore(StoreSettings.from_config(config), spec, fingerprint, **kwargs)


def device_occupancy(pool: Any, block_bytes: int) -> TierOccupancy:
    """The engine's block pool as a tier line in stats (blocks in use x bytes per block)."""
    return TierOccupancy("device", pool.num_used * block_bytes, pool.num_blocks * block_bytes, 0)
