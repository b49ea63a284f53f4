"""The session store with KV: ports.SessionKVAdmin over the records and the KV store.

The records part is RecordsOnlyStore's (records_only.py); this class adds what the KV store
(AttentionStore) changes in it: a read waits for the session's
pending save, token ids another model saved are blanked, deletes and purges take the KV too,
retention reaches placement, and the reports read the KV tiers. The device tier (the engine's
block pool) is not the store's: the API's admin service puts it before these tiers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from chatstore.store.attention_store import AttentionStore
from chatstore.store.ports import KVPlacement, OpenedTurn, SessionKVAdmin, TierStats
from chatstore.store.records.leases import SessionLeases
from chatstore.store.records.record import SessionRecord
from chatstore.store.records_only import RecordsOnlyStore
from chatstore.store.retention import Retention
from chatstore.store.session_kv import SessionKey
from chatstore.store.tiers.base import StorageTier


class SessionStore(RecordsOnlyStore):
    """ports.SessionKVAdmin with KV; the docs are on the port."""

    def __init__(self, kv: AttentionStore, leases: SessionLeases | None = None) -> None:
        """kv: the KV store, whose records these are; leases: default, in the records' Redis
        (held the store's session_lease_s by its replica_id), else local no-ops."""
        super().__init__(
            kv.records, kv.context, leases, kv.session_lease_s, kv.replica_id, kv.data_dir
        )
        self.kv = kv

    # -- a turn's KV --------------------------------------------------------------------------

    def match_prefix(self, tenant: str, token_ids: list[int]) -> str | None:
        """The records' prefix index, over this model's saved ids."""
        return self.records.match_prefix(tenant, token_ids, self.kv.fingerprint)

    def fit_context(
        self, tenant: str, session_id: str, prompt: list[int], head: int, tail: int, reserve: int
    ) -> list[int]:
        return self.kv.fit_context(tenant, session_id, prompt, head, tail, reserve)

    def open_turn(
        self, tenant: str, session_id: str, prompt_ids: Sequence[int] = ()
    ) -> OpenedTurn | None:
        """Chunks only SSD or Redis holds come up to DRAM now (from the worker thread that
        opens the turn: the engine's own thread never waits on a disk or Redis). The turn's
        chain is recorded by append_turn, with its messages: one record write per turn."""
        return self.kv.open_turn(tenant, session_id, prompt_ids, records_turn=True)

    def end_turn(self, turn: OpenedTurn | None) -> None:
        self.kv.end_turn(turn)

    def hint(self, tenant: str, session_id: str) -> None:
        """Returns at once: the store's prefetch thread moves the KV up to DRAM, its hint
        listeners (the connector's read buffer) stage it."""
        self.kv.hint(tenant, session_id)

    def placement(self, tenant: str, session_id: str) -> KVPlacement | None:
        return self.kv.placement(tenant, session_id)

    def kv_location(self, tenant: str, session_id: str) -> str | None:
        return self.kv.tier_of(tenant, session_id)

    # -- reports ------------------------------------------------------------------------------

    def tier_stats(self) -> list[TierStats]:
        """The store's tiers, fastest first; the first one also carries the store-wide
        counters (misses, bytes moved, prefetches)."""
        stats = self.kv.stats()
        c = stats.counters
        out = []
        for occ in stats.occupancy:
            tc = c.tiers.get(occ.name)
            first = occ.name == stats.first_tier
            out.append(
                TierStats(
                    name=occ.name,
                    capacity_bytes=occ.capacity_bytes,
                    used_bytes=occ.used_bytes,
                    sessions=occ.num_sessions,
                    hits=tc.hits if tc else 0,
                    misses=c.misses if first else 0,
                    bytes_up=c.bytes_up if first else 0,
                    bytes_down=c.bytes_down if first else 0,
                    evictions=tc.evictions if tc else 0,
                    prefetches=c.prefetches if first else 0,
                    write_failures_by_reason=dict(tc.write_failures) if tc else {},
                )
            )
        return out

    def open_failures(self) -> dict[str, int]:
        """`records`, then each slow tier's chunks."""
        return {**super().open_failures(), **self.kv.open_failures()}

    def remote_health(self) -> dict[str, object] | None:
        """The remote (Redis) tier's circuit breaker: state, failures, opens, short_circuited,
        last_error."""
        health = self.kv.stats().remote
        return dataclasses.asdict(health) if health is not None else None

    def flush(self, shared: bool = False) -> int:
        return self.kv.invalidate_all(shared)

    # -- RecordsOnlyStore's hooks -------------------------------------------------------------

    def _wait_saved(self, tenant: str, session_id: str) -> None:
        self.kv.wait_saved(tenant, session_id)

    def _own_model(self, record: SessionRecord) -> SessionRecord:
        """record, its token ids dropped when another model saved them (the next turn then
        renders the messages afresh rather than feed this model foreign ids)."""
        if record.fingerprint != self.kv.fingerprint:
            record.token_ids, record.kv_tokens, record.last_token = [], 0, None
        return record

    def _retain(self, saved: SessionRecord) -> None:
        retention = Retention(saved.priority, saved.ttl_s)
        self.kv.set_retention(saved.tenant, saved.session_id, retention)

    def _delete(self, key: SessionKey) -> bool:
        return self.kv.delete_session(key.tenant, key.session_id)

    def _purge(self) -> list[SessionKey]:
        return self.kv.purge_expired()

    def _shred(self, tenant: str) -> int:
        return self.kv.shred_tenant(tenant)  # the store shreds the key first itself

    def _reseal_scope(self) -> tuple[list[StorageTier], Path]:
        return list(self.kv.slow_tiers()), self.kv.data_dir

    def _close(self) -> None:
        self.kv.close()  # DRAM sessions move to LMDB; the records are closed with it


if TYPE_CHECKING:  # mypy checks here that both session stores keep the API's port

    def _implements_port(
        with_kv: SessionStore, records_only: RecordsOnlyStore
    ) -> tuple[SessionKVAdmin, SessionKVAdmin]:
        return with_kv, records_only
