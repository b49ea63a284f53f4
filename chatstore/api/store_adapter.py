"""The API's session-store port over chatstore.store.AttentionStore.

The store owns durable records (tenant, messages, token ids whose KV is saved, timestamps) and
the KV tiers; the engine's StoreConnector saves and loads KV. This adapter adds what the API
needs on top: pagination, the per-tenant session count, the tier numbers in the admin shape
(the device tier first, read from the engine's stats: also with kv_store = "off"), and the
session leases that keep replicas sharing one Redis from running turns on one session at once.
Records are the store's own `SessionRecord`; which session a client that resends its history
continues is the records' prefix index (chatstore/store/records/prefix_index.py).
"""

from __future__ import annotations

import builtins
import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chatstore.api.store_port import (
    DEVICE_TIER,
    INTERNAL_TENANT_PREFIX,
    SessionPlacement,
    TierStats,
)
from chatstore.engine.engine_stats import EngineStats
from chatstore.engine.kv_connector import KVConnector
from chatstore.store.records import (
    RecordConflict,
    RecordStore,
    ResponseRecords,
    SessionLease,
    SessionLeases,
    SessionRecord,
    session_leases,
)
from chatstore.store.retention import Retention
from chatstore.store.session_kv import SessionKey


def device_tier(stats: EngineStats) -> TierStats:
    """The engine's block pool as the fastest tier, every number the engine's own (one
    snapshot, no counter of its own here):

    used_bytes  blocks holding KV, in use or free and still prefix-cached, x bytes per block
    sessions    sessions whose history is in the prefix cache (BlockManager's module doc: the
                last full block a session computed or reused is still cached, and with it every
                block before it)
    hits        full prompt blocks found in the prefix cache at admission (engine prefix_hits)
    misses      full prompt blocks looked up and not found (engine prefix_misses)
    evictions   cached blocks reused for other content (engine prefix_evictions)

    KV loaded into the pool from the store is counted by the store's tiers and the engine's
    kv_loads, not here (bytes_up, bytes_down and prefetches stay 0)."""
    block = stats.block_bytes
    return TierStats(
        name=DEVICE_TIER,
        capacity_bytes=stats.num_blocks * block,
        used_bytes=stats.kv_blocks * block,
        sessions=stats.cached_sessions,
        hits=stats.prefix_hits,
        misses=stats.prefix_misses,
        bytes_up=0,
        bytes_down=0,
        evictions=stats.prefix_evictions,
        prefetches=0,
    )


class StoreAdapter:
    def __init__(
        self,
        store: Any,
        connector: KVConnector | None,
        records: RecordStore | None = None,
        leases: SessionLeases | None = None,
        engine_stats: Callable[[], EngineStats] | None = None,
    ) -> None:
        """store: an AttentionStore, or None (kv_store = "off": records only, no KV kept).
        leases: the session leases (default: in the records' Redis, or local no-ops).
        engine_stats: the engine's stats, whose block pool is the device tier (None: no line)."""
        self.store = store
        self._engine_stats = engine_stats
        self.records: RecordStore = records if records is not None else store.records
        self.leases: SessionLeases = (
            leases if leases is not None else self._leases(store, self.records)
        )
        self._connector = connector
        self._sessions: dict[str, set[str]] = {}  # tenant -> its session ids (counted)
        self._resealer: Any = None  # the key rotation job, once started (rotate_keys)
        self._lock = threading.Lock()

    @property
    def connector(self) -> KVConnector | None:
        return self._connector

    @property
    def responses(self) -> ResponseRecords:
        return self.records.responses

    # -- records ----------------------------------------------------------------------------

    def get(self, tenant: str, session_id: str) -> SessionRecord | None:
        self._wait_saved(tenant, session_id)
        record = self.records.get(SessionKey(tenant, session_id))
        return None if record is None else self._own_model(record)

    def create(self, record: SessionRecord) -> bool:
        """Write a new session's record; False when the id is taken (maybe by another
        replica a moment ago)."""
        try:
            self.records.create(record)
        except RecordConflict:
            return False
        self._counted(record)
        self._retain(record)
        return True

    def update(self, tenant: str, session_id: str, **changes: Any) -> SessionRecord | None:
        """Patch the record's retention fields or metadata (atomically, so a concurrent turn's
        messages are kept); the store's placement learns the new priority at once."""
        self._wait_saved(tenant, session_id)
        saved = self.records.patch(SessionKey(tenant, session_id), **changes)
        if saved is None:
            return None
        self._retain(saved)
        return self._own_model(saved)

    def _retain(self, saved: SessionRecord) -> None:
        if self.store is not None:
            self.store.set_retention(
                saved.tenant, saved.session_id, Retention(saved.priority, saved.ttl_s)
            )

    def placement(self, tenant: str, session_id: str) -> SessionPlacement | None:
        if self.store is None:
            return None
        tokens = self.store.kv_by_tier(tenant, session_id)
        return SessionPlacement(tokens, self.store.layout.bytes_per_token)

    def append_turn(
        self,
        record: SessionRecord,
        new_messages: list[dict[str, Any]],
        keep: int | None = None,
        kv_tokens: int = 0,
        last_token: int | None = None,
    ) -> None:
        """Append a turn to the stored messages if the record is still at `record.version`
        (what the turn read); RecordConflict otherwise. `record` becomes what was stored."""
        self._wait_saved(record.tenant, record.session_id)  # token_ids of the turn just ended
        key = SessionKey(record.tenant, record.session_id)
        saved = self.records.append_turn(
            key, record.version, new_messages, keep, kv_tokens=kv_tokens, last_token=last_token
        )
        for f in dataclasses.fields(SessionRecord):
            setattr(record, f.name, getattr(saved, f.name))
        self._own_model(record)
        self._counted(record)

    def acquire_lease(self, tenant: str, session_id: str) -> SessionLease | None:
        """The session's lease for one turn (or delete); None while another replica holds it."""
        return self.leases.acquire(SessionKey(tenant, session_id))

    def release_lease(self, lease: SessionLease, wait: bool = True) -> None:
        """wait=False: return at once (the event loop), the release goes out in the background."""
        self.leases.release(lease, wait)

    def delete(self, tenant: str, session_id: str) -> bool:
        with self._lock:
            self._sessions.get(tenant, set()).discard(session_id)
        if self.store is None:
            return bool(self.records.delete(SessionKey(tenant, session_id)))
        return bool(self.store.delete_session(tenant, session_id))

    def count_sessions(self, tenant: str) -> int:
        with self._lock:
            return len(self._tenant_sessions(tenant))

    def purge_expired(self) -> int:
        """Delete sessions idle past the TTL, records and KV; how many went."""
        if self.store is not None:
            gone = self.store.purge_expired()
        else:
            gone = self.records.purge_expired()
        with self._lock:
            for key in gone:
                self._sessions.get(key.tenant, set()).discard(key.session_id)
        return len(gone)

    def list(
        self, tenant: str | None, offset: int, limit: int
    ) -> tuple[builtins.list[SessionRecord], int]:
        records = self.records.list_sessions(tenant)
        if tenant is None:  # all tenants: the users', not the server's own namespaces
            records = [r for r in records if not r.tenant.startswith(INTERNAL_TENANT_PREFIX)]
        records.sort(key=lambda r: (r.updated_at, r.session_id), reverse=True)
        return [self._own_model(r) for r in records[offset : offset + limit]], len(records)

    # -- KV ---------------------------------------------------------------------------------

    def match_prefix(self, tenant: str, token_ids: builtins.list[int]) -> str | None:
        """The records' prefix index, for this model's saved ids (no store: none are saved)."""
        if self.store is None:
            return None
        return self.records.match_prefix(tenant, token_ids, self.store.fingerprint)

    def kv_location(self, tenant: str, session_id: str) -> str | None:
        if self.store is None:
            return None
        return self.store.tier_of(tenant, session_id)

    def fetch_remote(self, tenant: str, session_id: str) -> None:
        """Bring the session's chunks held only by Redis up to DRAM now (called from the
        worker thread that opens a turn: the engine's own thread never waits on Redis)."""
        if self.store is not None:
            self.store.fetch_remote(tenant, session_id)

    def prefetch(self, tenant: str, session_id: str) -> None:
        """Returns at once: the store's prefetch thread moves the KV up to DRAM and the
        connector's loader stages it in the read buffer (when it has one)."""
        if self.store is not None:
            self.store.prefetch(tenant, session_id)
            if self.connector is not None:
                self.connector.stage(tenant, session_id)

    def fit_context(
        self,
        tenant: str,
        session_id: str,
        prompt: builtins.list[int],
        head: int,
        tail: int,
        reserve: int,
    ) -> builtins.list[int]:
        if self.store is None:
            return prompt
        # The store sizes its cut by the prompt's length: `reserve` placeholder tokens at the
        # end (inside the kept tail, after the saved history) make room for the reply too.
        padded = prompt + [0] * reserve
        cut = self.store.fit_context(tenant, session_id, padded, head, tail + reserve)
        return cut[: len(cut) - reserve] if reserve else cut

    def tier_stats(self) -> builtins.list[TierStats]:
        """The device tier (from the engine), then the store's tiers, fastest first."""
        out = [] if self._engine_stats is None else [device_tier(self._engine_stats())]
        if self.store is None:
            return out
        stats = self.store.stats()
        c = stats.counters
        for occ in stats.occupancy:
            tc = c.tiers.get(occ.name)
            first_store_tier = occ.name == stats.first_tier
            out.append(
                TierStats(
                    name=occ.name,
                    capacity_bytes=occ.capacity_bytes,
                    used_bytes=occ.used_bytes,
                    sessions=occ.num_sessions,
                    hits=tc.hits if tc else 0,
                    misses=c.misses if first_store_tier else 0,
                    bytes_up=c.bytes_up if first_store_tier else 0,
                    bytes_down=c.bytes_down if first_store_tier else 0,
                    evictions=tc.evictions if tc else 0,
                    prefetches=c.prefetches if first_store_tier else 0,
                    write_failures_by_reason=dict(tc.write_failures) if tc else {},
                )
            )
        return out

    def open_failures(self) -> dict[str, int]:
        """Stored values that failed to open (encryption at rest: another or a shredded key,
        a changed byte), per slow tier and `records` (sessions and stored Responses)."""
        out = {"records": int(getattr(self.records, "open_failures", 0))}
        if self.store is not None:
            counters = self.store.stats().counters
            for tier in self.store.tiers.slow:
                out[tier.name] = counters.tier(tier.name).open_failures
        return out

    def rotate_keys(self) -> dict[str, Any] | None:
        """Start (or resume, or report) re-sealing every stored value under the newest key in
        the background (sealing/reseal.py); its progress. None: encryption at rest is off."""
        resealer = self._get_resealer()
        if resealer is None:
            return None
        resealer.start()
        return self.rotation_progress()

    def rotation_progress(self) -> dict[str, Any] | None:
        """The key rotation's progress, as saved by the last job if none ran in this process
        (phase "idle": none yet under the current key); None: encryption at rest is off."""
        resealer = self._get_resealer()
        if resealer is None:
            return None
        progress = resealer.progress
        return {**dataclasses.asdict(progress), "done": progress.done}

    def _get_resealer(self) -> Any:
        from chatstore.store.sealing.reseal import Resealer

        sealer = getattr(self.records, "sealer", None)
        if sealer is None:
            return None
        with self._lock:
            if self._resealer is None:
                if self.store is not None:
                    tiers, data_dir = self.store.tiers.slow, self.store.settings.data_dir
                else:
                    tiers, data_dir = [], Path(getattr(self.records, "path", ".")).parent
                self._resealer = Resealer(sealer.sealing_id, self.records, tiers, data_dir)
            return self._resealer

    def shred_tenant(self, tenant: str) -> dict[str, int]:
        """Crypto-shred tenant: destroy its key (all its sealed data stops opening at once),
        then delete its sessions, KV and stored Responses; how many of each went."""
        sealer = getattr(self.records, "sealer", None)
        if self.store is None and sealer is not None:  # the store shreds first itself
            sealer.keyring.shred(tenant)  # first: nothing of it opens from here on
        with self._lock:
            self._sessions.pop(tenant, None)
        with_kv = self.store.shred_tenant(tenant) if self.store is not None else 0
        records = self.records.delete_tenant(tenant)
        responses = self.records.responses.delete_tenant(tenant)
        return {"sessions": max(with_kv, records), "responses": responses}

    def flush(self) -> int:
        if self.store is None:
            return 0
        return self.store.invalidate_all()

    def close(self) -> None:
        """After the engine has stopped: the connector's threads, the leases, then the store."""
        if self._connector is not None:
            self._connector.close()
        if self._resealer is not None:
            self._resealer.stop()  # its cursor is saved: the next rotate-keys resumes there
        self.leases.close()
        if self.store is not None:
            self.store.close()  # DRAM sessions move to LMDB; records are closed with it
        else:
            self.records.close()

    def remote_health(self) -> dict[str, Any] | None:
        """The remote (Redis) tier's circuit breaker: state, failures, opens, short_circuited,
        last_error; None without a remote tier."""
        health = self.store.stats().remote if self.store is not None else None
        return dataclasses.asdict(health) if health is not None else None

    # -- helpers ----------------------------------------------------------------------------

    @staticmethod
    def _leases(store: Any, records: RecordStore) -> SessionLeases:
        settings = getattr(store, "settings", None)
        lease_s = getattr(settings, "session_lease_s", 30.0)
        return session_leases(records, lease_s, getattr(settings, "replica_id", ""))

    def _counted(self, record: SessionRecord) -> None:
        with self._lock:
            self._tenant_sessions(record.tenant).add(record.session_id)

    def _wait_saved(self, tenant: str, session_id: str) -> None:
        if self.store is not None:
            self.store.wait_saved(tenant, session_id)

    def _tenant_sessions(self, tenant: str) -> set[str]:
        sessions = self._sessions.get(tenant)
        if sessions is None:
            sessions = {r.session_id for r in self.records.list_sessions(tenant)}
            self._sessions[tenant] = sessions
        return sessions

    def _own_model(self, record: SessionRecord) -> SessionRecord:
        """record, its token ids dropped when another model saved them (the next turn then
        renders the messages afresh rather than feed this model foreign ids)."""
        if self.store is not None and record.fingerprint != self.store.fingerprint:
            record.token_ids, record.kv_tokens, record.last_token = [], 0, None
        return record
