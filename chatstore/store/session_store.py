"""The API's session store, ports.SessionKVAdmin: the session records, pagination, the
per-tenant session count (the records' own, shared by replicas), the leases that keep replicas
sharing one Redis from running turns on one session at once, stored Responses, key rotation and
crypto-shredding; and the KV behind the records (session_kv_half.py): the KV store
(`SessionStore(records, kv)`), or none when kv_store = "off" (`SessionStore(records)`: every
turn recomputes its prompt).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chatstore.store.ports import ContextBudget, KVPlacement, OpenedTurn, TierStats
from chatstore.store.records.base import RecordStore
from chatstore.store.records.leases import SessionLeases, session_leases
from chatstore.store.records.record import RecordConflict, SessionLease, SessionRecord
from chatstore.store.records.responses import ResponseRecords
from chatstore.store.session_kv import SessionKey
from chatstore.store.session_kv_half import KVHalf, NoKV, StoreKV

if TYPE_CHECKING:
    from chatstore.store.attention_store import AttentionStore
    from chatstore.store.ports import SessionKVAdmin
    from chatstore.store.sealing.reseal import Resealer

WAIT_SAVED_S = 30.0  # the longest an append waits for its turn's commit (the writer's queue)

# Tenants starting with a NUL were the server's own namespaces (stored Responses, before they
# had a namespace of their own): no configured tenant can hold a NUL, so users never see them.
INTERNAL_TENANT_PREFIX = "\x00"


class SessionStore:
    """ports.SessionKVAdmin, with KV or without; the docs are on the port."""

    def __init__(
        self,
        records: RecordStore,
        kv: AttentionStore | None = None,
        *,
        context: ContextBudget | None = None,
        leases: SessionLeases | None = None,
        lease_s: float | None = None,
        replica_id: str | None = None,
        data_dir: Path | None = None,
    ) -> None:
        """records: the session records (the KV store's own when `kv` is given); kv: the KV
        store, None when every turn recomputes. context, lease_s, replica_id and data_dir
        default to the KV store's (records only: context is required). leases: default, in the
        records' Redis (held lease_s by replica_id), else local no-ops. data_dir: where the key
        rotation keeps its cursor (default: beside the records)."""
        if kv is not None and kv.records is not records:
            raise ValueError("SessionStore: records must be the KV store's own records")
        if context is None:
            if kv is None:
                raise ValueError("SessionStore without a KV store needs its context budget")
            context = kv.context
        if kv is not None:
            lease_s = kv.session_lease_s if lease_s is None else lease_s
            replica_id = kv.replica_id if replica_id is None else replica_id
        self.records = records
        self.context = context
        self.kv = kv  # the KV store itself (None: records only), for the tests and tools
        self.kv_half: KVHalf = StoreKV(kv) if kv is not None else NoKV(records, data_dir)
        if leases is None:
            leases = session_leases(records, lease_s or 30.0, replica_id or "")
        self.leases = leases
        self._resealer: Resealer | None = None  # the key rotation job, once started
        self._lock = threading.Lock()

    @property
    def responses(self) -> ResponseRecords:
        return self.records.responses

    # -- records ----------------------------------------------------------------------------

    def get(self, tenant: str, session_id: str) -> SessionRecord | None:
        self.kv_half.wait_saved(tenant, session_id)
        record = self.records.get(SessionKey(tenant, session_id))
        return None if record is None else self.kv_half.own_model(record)

    def create(self, record: SessionRecord) -> bool:
        """False when the id is taken (maybe by another replica a moment ago)."""
        try:
            self.records.create(record)
        except RecordConflict:
            return False
        self.kv_half.retain(record)
        return True

    def update(self, tenant: str, session_id: str, **changes: object) -> SessionRecord | None:
        """Patched atomically, so a concurrent turn's messages are kept; the KV placement
        learns a new priority at once."""
        self.kv_half.wait_saved(tenant, session_id)
        saved = self.records.patch(SessionKey(tenant, session_id), **changes)
        if saved is None:
            return None
        self.kv_half.retain(saved)
        return self.kv_half.own_model(saved)

    def append_turn(
        self,
        record: SessionRecord,
        new_messages: list[dict[str, Any]],
        keep: int | None = None,
        kv_tokens: int = 0,
        last_token: int | None = None,
        turn: OpenedTurn | None = None,
        lease: SessionLease | None = None,
    ) -> None:
        try:
            self._append(record, new_messages, keep, kv_tokens, last_token, turn)
        finally:
            if lease is not None:
                self.leases.release(lease)

    def _append(
        self,
        record: SessionRecord,
        new_messages: list[dict[str, Any]],
        keep: int | None,
        kv_tokens: int,
        last_token: int | None,
        turn: OpenedTurn | None,
    ) -> None:
        key = SessionKey(record.tenant, record.session_id)
        chain = None
        if turn is not None and turn.chain is not None:
            chain = turn.chain.take(WAIT_SAVED_S)  # its commit: the KV chain to record
        else:
            self.kv_half.wait_saved(record.tenant, record.session_id)  # opened elsewhere
        saved = self.records.append_turn(
            key, record.version, new_messages, keep, chain, kv_tokens=kv_tokens,
            last_token=last_token,
        )  # fmt: skip
        for f in dataclasses.fields(SessionRecord):
            setattr(record, f.name, getattr(saved, f.name))
        self.kv_half.own_model(record)

    def acquire_lease(self, tenant: str, session_id: str) -> SessionLease | None:
        return self.leases.acquire(SessionKey(tenant, session_id))

    def release_lease(self, lease: SessionLease, wait: bool = True) -> None:
        self.leases.release(lease, wait)

    def delete(self, tenant: str, session_id: str) -> bool:
        return self.kv_half.delete(SessionKey(tenant, session_id))

    def list_sessions(
        self, tenant: str | None, offset: int, limit: int
    ) -> tuple[list[SessionRecord], int]:
        records = self.records.list_sessions(tenant)
        if tenant is None:  # all tenants: the users', not the server's own namespaces
            records = [r for r in records if not r.tenant.startswith(INTERNAL_TENANT_PREFIX)]
        records.sort(key=lambda r: (r.updated_at, r.session_id), reverse=True)
        return [self.kv_half.own_model(r) for r in records[offset : offset + limit]], len(records)

    def count_sessions(self, tenant: str) -> int:
        """The records' own count (a counter or an index they keep with the sessions): every
        replica sharing them sees the same, so the tenant's quota holds across replicas."""
        return self.records.count_sessions(tenant)

    def purge_expired(self) -> int:
        return len(self.kv_half.purge())

    # -- a turn's KV and the reports: the KV half's ------------------------------------------

    def match_prefix(self, tenant: str, token_ids: list[int]) -> str | None:
        return self.kv_half.match_prefix(tenant, token_ids)

    def fit_context(
        self, tenant: str, session_id: str, prompt: list[int], head: int, tail: int, reserve: int
    ) -> list[int]:
        return self.kv_half.fit_context(tenant, session_id, prompt, head, tail, reserve)

    def open_turn(
        self, tenant: str, session_id: str, prompt_ids: Sequence[int] = ()
    ) -> OpenedTurn | None:
        return self.kv_half.open_turn(tenant, session_id, prompt_ids)

    def end_turn(self, turn: OpenedTurn | None) -> None:
        self.kv_half.end_turn(turn)

    def hint(self, tenant: str, session_id: str) -> None:
        self.kv_half.hint(tenant, session_id)

    def placement(self, tenant: str, session_id: str) -> KVPlacement | None:
        return self.kv_half.placement(tenant, session_id)

    def kv_location(self, tenant: str, session_id: str) -> str | None:
        return self.kv_half.kv_location(tenant, session_id)

    def tier_stats(self) -> list[TierStats]:
        return self.kv_half.tier_stats()

    def open_failures(self) -> dict[str, int]:
        """Values that failed to open (encryption at rest: another or a shredded key, a changed
        byte): `records` (sessions and stored Responses), then each slow tier's chunks."""
        return self.kv_half.open_failures()

    def remote_health(self) -> dict[str, object] | None:
        return self.kv_half.remote_health()

    def flush(self, shared: bool = False) -> int:
        return self.kv_half.flush(shared)

    # -- keys ---------------------------------------------------------------------------------

    def rewrap_keys(self) -> int | None:
        """Wrap every data key by the newest master key (seconds: no value is touched)."""
        sealer = self.records.sealer
        return sealer.keyring.rewrap_all() if sealer is not None else None

    def rotate_keys(self, job: str = "data-keys") -> dict[str, object] | None:
        """Start (or resume, or report) a job over every stored value in the background
        (sealing/reseal.py: data-keys, encrypt-existing)."""
        resealer = self._get_resealer()
        if resealer is None:
            return None
        resealer.start(job)
        return self.rotation_progress()

    def rotation_progress(self) -> dict[str, object] | None:
        """As saved by the last job if none ran in this process (phase "idle": none yet under
        the current key)."""
        resealer = self._get_resealer()
        if resealer is None:
            return None
        progress = resealer.progress
        return {**dataclasses.asdict(progress), "done": progress.done}

    def shred_tenant(self, tenant: str) -> dict[str, int]:
        """Destroy the tenant's key first (all its sealed data stops opening at once), then
        delete its sessions, KV and stored Responses."""
        with_kv = self.kv_half.shred(tenant)
        records = self.records.delete_tenant(tenant)
        responses = self.records.responses.delete_tenant(tenant)
        return {"sessions": max(with_kv, records), "responses": responses}

    def close(self) -> None:
        """The key rotation (its cursor is saved: the next rotate-keys resumes there), the
        leases, then the records (with the KV store, when there is one)."""
        if self._resealer is not None:
            self._resealer.stop()
        self.leases.close()
        self.kv_half.close()

    # -- helpers ------------------------------------------------------------------------------

    def _get_resealer(self) -> Resealer | None:
        from chatstore.store.sealing.reseal import Resealer

        sealer = self.records.sealer
        if sealer is None:
            return None
        with self._lock:
            if self._resealer is None:
                tiers, data_dir = self.kv_half.reseal_scope()
                self._resealer = Resealer(sealer.keyring, self.records, tiers, data_dir)
            return self._resealer


if TYPE_CHECKING:  # mypy checks here that the session store keeps the API's port

    def _implements_port(store: SessionStore) -> SessionKVAdmin:
        return store
