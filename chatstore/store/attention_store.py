"""AttentionStore: session KV across turns in DRAM -> LMDB -> Redis, plus durable records.

Built from config by `create_store` (None when `kv_store = "off"`). Everything on disk lives
under `data_dir`:

    <data_dir>/kv.lmdb        SSD tier (session KV; remembers the model fingerprint)
    <data_dir>/records.lmdb   session records (when no Redis is configured)

Placement (`policy`): a `PolicyChooser` over `make_policy(policy, tier capacities)` decides which
session a full tier gives up; its look-ahead is the engine's waiting queue, handed in with
`set_waiting_queue` (scheduler-aware eviction, §3.3.2). Two background threads, both started on
first use: `Prefetcher` moves queued / hinted sessions up to DRAM (§3.3.1) and `WriteBuffer`
commits finished turns saved with `save_later` (async save, §3.2.2).

Reads of a session with a turn still queued in the write buffer get that turn from the buffer
(`WriteBuffer.peek`: the very value the writer commits), not after waiting for the commit.

`version(tenant, session_id)` changes whenever the session's saved KV may have changed (save,
save_later at submit, delete, truncation, expiry purge, invalidate_all) and not when it only
moves between tiers: a component holding a copy of a session's KV compares versions to know
whether its copy is stale.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from chatstore.config import Config
from chatstore.model.spec import ModelSpec
from chatstore.store.decoupled import plan_truncation
from chatstore.store.dram_tier import DramTier, KVLayout
from chatstore.store.events import EventLog, Listener, StoreStats
from chatstore.store.hierarchy import TierHierarchy
from chatstore.store.lmdb_tier import LmdbTier
from chatstore.store.policy import PolicyChooser, make_policy
from chatstore.store.prefetcher import Prefetcher
from chatstore.store.records import LmdbRecordStore, RecordStore, RedisRecordStore
from chatstore.store.redis_tier import RedisTier
from chatstore.store.session_kv import SessionKey, SessionKV, common_prefix_len
from chatstore.store.tier import StorageTier, TierOccupancy
from chatstore.store.victims import VictimChooser
from chatstore.store.writer import WriteBuffer

WAIT_SAVED_S = 30.0  # the longest a reader waits for a session's pending write


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
    policy: str = "aware"  # aware | lru | fifo
    prefetch_interval_s: float = 0.05
    async_save: bool = False  # save_later() writes in the background (the server turns it on)
    write_buffer_bytes: int = 1 << 30

    @classmethod
    def from_config(cls, config: Config) -> StoreSettings:
        data_dir = config.data_dir or os.environ.get("CHATSTORE_DATA_DIR", "")
        return cls(
            data_dir=Path(data_dir).expanduser() if data_dir else default_data_dir(),
            dram_bytes=config.dram_bytes,
            ssd_bytes=config.ssd_bytes,
            redis_url=config.redis_url,
            redis_bytes=config.redis_bytes,
            storage_dtype=config.storage_torch_dtype,
            session_ttl_s=config.session_ttl_s,
            max_context_tokens=config.max_context_tokens,
            truncation_ratio=config.truncation_ratio,
            block_size=config.block_size,
            policy=config.policy,
            prefetch_interval_s=config.prefetch_interval_s,
            async_save=config.async_save,
            write_buffer_bytes=config.write_buffer_bytes,
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
        self._queue_source: Callable[[], Iterable[SessionKey]] = tuple
        if chooser is None:
            chooser = PolicyChooser(
                make_policy(settings.policy, [t.capacity for t in tiers]),
                queue=lambda: self._queue_source(),
                mean_kv_bytes=lambda: self.hierarchy.mean_kv_bytes(),
            )
        self.hierarchy = TierHierarchy(tiers, chooser, self.events)
        self.writer = WriteBuffer(self._commit, settings.write_buffer_bytes)
        self.prefetcher = Prefetcher(
            self.hierarchy,
            self._prefetch_candidates,
            settings.prefetch_interval_s,
            busy=self.writer.is_pending,
        )
        self.records: RecordStore = (
            RedisRecordStore(remote, settings.session_ttl_s)
            if remote
            else LmdbRecordStore(settings.data_dir / "records.lmdb", settings.session_ttl_s)
        )
        # version(): one counter for every key and the epoch, so max(key's, epoch) only grows.
        self._version_clock = itertools.count(1)
        self._versions: dict[SessionKey, int] = {}
        self._epoch = 0
        self._version_lock = threading.Lock()

    @staticmethod
    def key(tenant: str, session_id: str) -> SessionKey:
        return SessionKey(tenant, session_id)

    def tier(self, name: str) -> StorageTier | None:
        return next((t for t in self.hierarchy.tiers if t.name == name), None)

    # -- scheduler-aware placement --------------------------------------------------------

    def set_waiting_queue(self, source: Callable[[], Iterable[SessionKey]]) -> None:
        """The engine's waiting queue as session keys, soonest first (thread-safe callable):
        the look-ahead for eviction and for the prefetch thread, which starts now."""
        self._queue_source = source
        if len(self.hierarchy.tiers) > 1:
            self.prefetcher.start()

    def prefetch(self, tenant: str, session_id: str) -> None:
        """Hint: this session runs soon; move its KV up to DRAM in the background."""
        if len(self.hierarchy.tiers) > 1:
            self.prefetcher.hint(self.key(tenant, session_id))

    def _prefetch_candidates(self) -> list[Hashable]:
        candidates = getattr(self.hierarchy.chooser, "prefetch_candidates", None)
        if candidates is None:
            return []
        with self.hierarchy.lock:
            return candidates(self.hierarchy.tier_of, top=self.hierarchy.tiers[0].name)

    # -- KV ---------------------------------------------------------------------------------

    def wait_saved(self, tenant: str, session_id: str, timeout: float = WAIT_SAVED_S) -> bool:
        """Until no write of the session is pending (its newest turn is fully stored)."""
        return self.writer.wait(self.key(tenant, session_id), timeout)

    def flush_writes(self, timeout: float | None = None) -> bool:
        return self.writer.flush(timeout)

    def tier_of(self, tenant: str, session_id: str) -> str | None:
        self.wait_saved(tenant, session_id)
        return self.hierarchy.tier_of(self.key(tenant, session_id))

    def lookup(self, tenant: str, session_id: str) -> SessionKV | None:
        """The session's saved KV (moved up to DRAM), or None; an expired session is forgotten.

        A turn still queued in the write buffer is returned from there (built now if the
        writer has not built it yet): it is the newest complete turn, the same object the
        writer commits — read-only. Its record is refreshed by that commit, so it is not
        checked for expiry. Only if its build failed is the commit waited for."""
        key = self.key(tenant, session_id)
        pending = self.writer.peek(key)
        if isinstance(pending, SessionKV):
            self.hierarchy.count_pending_hit(key, pending)
            return pending
        self.writer.wait(key, WAIT_SAVED_S)
        record = self.records._load(key)
        if record is not None and self.records.expired(record):
            self.delete_session(tenant, session_id)
            return None
        return self.hierarchy.get(key)

    def save(self, tenant: str, session_id: str, value: SessionKV) -> str | None:
        """Keep value as the session's KV (whole turn at once); the tier it landed in."""
        key = self.key(tenant, session_id)
        self.writer.wait(key, WAIT_SAVED_S)  # keep the order of turns
        landed = self._commit(key, value)
        self._bump_version(key)  # after: a version read before it sees the old number
        return landed

    def save_later(
        self, tenant: str, session_id: str, build: Callable[[], SessionKV], nbytes: int
    ) -> None:
        """Save `build()` as the session's KV: in the writer thread with `async_save` (blocking
        only while the write buffer holds `write_buffer_bytes`), else right here."""
        if not self.settings.async_save:
            self.save(tenant, session_id, build())
            return
        key, dtype = self.key(tenant, session_id), self.settings.storage_dtype
        # In the storage dtype already: what lookup() peeks is exactly what gets committed.
        self.writer.submit(key, lambda: build().to(dtype), nbytes)
        self._bump_version(key)  # after submit: lookup() finds the new turn from now on

    def _commit(self, key: Hashable, value: SessionKV) -> str | None:
        assert isinstance(key, SessionKey)
        value = value.to(self.settings.storage_dtype)
        landed = self.hierarchy.put(key, value)
        self.records.upsert(key, token_ids=list(value.token_ids) if landed else [])
        return landed

    def saved_tokens(self, tenant: str, session_id: str) -> list[int]:
        self.wait_saved(tenant, session_id)
        record = self.records.get(self.key(tenant, session_id))
        return list(record.token_ids) if record else []

    def delete_session(self, tenant: str, session_id: str) -> bool:
        """Remove the session's KV from every tier and its record."""
        key = self.key(tenant, session_id)
        self.writer.wait(key, WAIT_SAVED_S)
        found = self.hierarchy.delete(key)
        self._bump_version(key)
        return self.records.delete(key) or found

    def purge_expired(self) -> list[SessionKey]:
        self.writer.flush(WAIT_SAVED_S)
        gone = self.records.purge_expired()
        for key in gone:
            self.hierarchy.delete(key)
            self._bump_version(key)
        return gone

    def invalidate_all(self) -> None:
        self.writer.flush(WAIT_SAVED_S)
        self.hierarchy.clear()
        with self._version_lock:
            self._epoch = next(self._version_clock)
            self._versions.clear()  # every entry is below the new epoch: max() ignores it

    def version(self, tenant: str, session_id: str) -> int:
        """A number that changes whenever the session's saved KV may have changed (saved,
        queued for saving, deleted, truncated, purged, everything invalidated) and stays the
        same while it only moves between tiers. Read it *before* looking the session up:
        a copy looked up after reading version v is at least as new as v."""
        with self._version_lock:
            return max(self._versions.get(self.key(tenant, session_id), 0), self._epoch)

    def _bump_version(self, key: SessionKey) -> None:
        # Kept for deleted sessions too: forgetting one could hand back an old number.
        with self._version_lock:
            self._versions[key] = next(self._version_clock)

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
        """Graceful shutdown: pending writes land, DRAM sessions move to LMDB (so a restart
        finds them), then close."""
        self.prefetcher.close()
        self.writer.close()
        if flush_dram and len(self.hierarchy.tiers) > 1 and self.tier("dram") is not None:
            self.hierarchy.demote_all(0)
        self.hierarchy.settle()  # deferred deletions of stale copies land before closing
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
