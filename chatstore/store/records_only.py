"""The session store with records only (kv_store = "off": every turn recomputes its prompt).

`RecordsOnlyStore` implements ports.SessionKVAdmin over the session records alone: records,
pagination, the per-tenant session count (the records' own, shared by replicas), the leases that
keep replicas sharing one Redis from running turns on one session at once, stored Responses, key
rotation and crypto-shredding. The KV half of the port answers as a store without KV does
(nothing saved, nothing placed, prompts never cut). `SessionStore` (session_store.py) is the
same with the KV store behind it; the places it differs are the `_...` hooks at the end of this
class.
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
from chatstore.store.tiers.base import StorageTier

if TYPE_CHECKING:
    from chatstore.store.sealing.reseal import Resealer

WAIT_SAVED_S = 30.0  # the longest an append waits for its turn's commit (the writer's queue)

# Tenants starting with a NUL were the server's own namespaces (stored Responses, before they
# had a namespace of their own): no configured tenant can hold a NUL, so users never see them.
INTERNAL_TENANT_PREFIX = "\x00"


class RecordsOnlyStore:
    """ports.SessionKVAdmin without KV; the docs are on the port."""

    def __init__(
        self,
        records: RecordStore,
        context: ContextBudget,
        leases: SessionLeases | None = None,
        lease_s: float = 30.0,
        replica_id: str = "",
        data_dir: Path | None = None,
    ) -> None:
        """leases: the session leases (default: in the records' Redis, else local no-ops, held
        lease_s by replica_id). data_dir: where the key rotation keeps its cursor (default:
        beside the records)."""
        self.records = records
        self.context = context
        self.leases = leases if leases is not None else session_leases(records, lease_s, replica_id)
        self._data_dir = data_dir
        self._resealer: Resealer | None = None  # the key rotation job, once started
        self._lock = threading.Lock()

    @property
    def responses(self) -> ResponseRecords:
        return self.records.responses

    # -- records ----------------------------------------------------------------------------

    def get(self, tenant: str, session_id: str) -> SessionRecord | None:
        self._wait_saved(tenant, session_id)
        record = self.records.get(SessionKey(tenant, session_id))
        return None if record is None else self._own_model(record)

    def create(self, record: SessionRecord) -> bool:
        """False when the id is taken (maybe by another replica a moment ago)."""
        try:
            self.records.create(record)
        except RecordConflict:
            return False
        self._retain(record)
        return True

    def update(self, tenant: str, session_id: str, **changes: object) -> SessionRecord | None:
        """Patched atomically, so a concurrent turn's messages are kept; the KV placement
        learns a new priority at once."""
        self._wait_saved(tenant, session_id)
        saved = self.records.patch(SessionKey(tenant, session_id), **changes)
        if saved is None:
            return None
        self._retain(saved)
        return self._own_model(saved)

    def append_turn(
        self,
        record: SessionRecord,
        new_messages: list[dict[str, Any]],
        keep: int | None = None,
        kv_tokens: int = 0,
        last_token: int | None = None,
        turn: OpenedTurn | None = None,
    ) -> None:
        key = SessionKey(record.tenant, record.session_id)
        chain = None
        if turn is not None and turn.chain is not None:
            chain = turn.chain.take(WAIT_SAVED_S)  # its commit: the KV chain to record
        else:
            self._wait_saved(record.tenant, record.session_id)  # a turn opened elsewhere
        saved = self.records.append_turn(
            key,
            record.version,
            new_messages,
            keep,
            chain,
            kv_tokens=kv_tokens,
            last_token=last_token,
        )
        for f in dataclasses.fields(SessionRecord):
            setattr(record, f.name, getattr(saved, f.name))
        self._own_model(record)

    def acquire_lease(self, tenant: str, session_id: str) -> SessionLease | None:
        return self.leases.acquire(SessionKey(tenant, session_id))

    def release_lease(self, lease: SessionLease, wait: bool = True) -> None:
        self.leases.release(lease, wait)

    def delete(self, tenant: str, session_id: str) -> bool:
        return self._delete(SessionKey(tenant, session_id))

    def list_sessions(
        self, tenant: str | None, offset: int, limit: int
    ) -> tuple[list[SessionRecord], int]:
        records = self.records.list_sessions(tenant)
        if tenant is None:  # all tenants: the users', not the server's own namespaces
            records = [r for r in records if not r.tenant.startswith(INTERNAL_TENANT_PREFIX)]
        records.sort(key=lambda r: (r.updated_at, r.session_id), reverse=True)
        return [self._own_model(r) for r in records[offset : offset + limit]], len(records)

    def count_sessions(self, tenant: str) -> int:
        """The records' own count (a counter or an index they keep with the sessions): every
        replica sharing them sees the same, so the tenant's quota holds across replicas."""
        return self.records.count_sessions(tenant)

    def purge_expired(self) -> int:
        return len(self._purge())

    # -- a turn's KV: none kept --------------------------------------------------------------

    def match_prefix(self, tenant: str, token_ids: list[int]) -> str | None:
        return None  # no token ids are saved without KV

    def fit_context(
        self, tenant: str, session_id: str, prompt: list[int], head: int, tail: int, reserve: int
    ) -> list[int]:
        return prompt  # nothing to cut with: the API refuses a prompt that does not fit

    def open_turn(
        self, tenant: str, session_id: str, prompt_ids: Sequence[int] = ()
    ) -> OpenedTurn | None:
        return None  # no KV: the engine computes every prompt

    def end_turn(self, turn: OpenedTurn | None) -> None:
        pass  # nothing opened

    def hint(self, tenant: str, session_id: str) -> None:
        pass  # no KV to move up

    def placement(self, tenant: str, session_id: str) -> KVPlacement | None:
        return None

    def kv_location(self, tenant: str, session_id: str) -> str | None:
        return None

    # -- reports and keys ---------------------------------------------------------------------

    def tier_stats(self) -> list[TierStats]:
        return []

    def open_failures(self) -> dict[str, int]:
        """Values that failed to open (encryption at rest: another or a shredded key, a changed
        byte): `records` (sessions and stored Responses)."""
        return {"records": self.records.open_failures}

    def remote_health(self) -> dict[str, object] | None:
        return None

    def flush(self, shared: bool = False) -> int:
        return 0

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
        with_kv = self._shred(tenant)
        records = self.records.delete_tenant(tenant)
        responses = self.records.responses.delete_tenant(tenant)
        return {"sessions": max(with_kv, records), "responses": responses}

    def close(self) -> None:
        """The key rotation (its cursor is saved: the next rotate-keys resumes there), the
        leases, then the records (with the KV store, when there is one)."""
        if self._resealer is not None:
            self._resealer.stop()
        self.leases.close()
        self._close()

    # -- where the session store with KV differs (session_store.py) ----------------------------

    def _wait_saved(self, tenant: str, session_id: str) -> None:
        pass  # no pending KV write

    def _own_model(self, record: SessionRecord) -> SessionRecord:
        return record

    def _retain(self, saved: SessionRecord) -> None:
        pass  # no KV placement to tell

    def _delete(self, key: SessionKey) -> bool:
        return bool(self.records.delete(key))

    def _purge(self) -> list[SessionKey]:
        return self.records.purge_expired()

    def _shred(self, tenant: str) -> int:
        """Shred the tenant's data keys; its sessions with KV (none here)."""
        sealer = self.records.sealer
        if sealer is not None:
            sealer.keyring.shred(tenant)  # first: nothing of it opens from here on
        return 0

    def _reseal_scope(self) -> tuple[list[StorageTier], Path]:
        """The KV tiers a key rotation re-seals, and where it keeps its cursor."""
        data_dir = self._data_dir or Path(getattr(self.records, "path", ".")).parent
        return [], data_dir

    def _close(self) -> None:
        self.records.close()
        if self.records.sealer is not None:
            self.records.sealer.keyring.store.close()  # the data keys, after their last user

    # -- helpers ------------------------------------------------------------------------------

    def _get_resealer(self) -> Resealer | None:
        from chatstore.store.sealing.reseal import Resealer

        sealer = self.records.sealer
        if sealer is None:
            return None
        with self._lock:
            if self._resealer is None:
                tiers, data_dir = self._reseal_scope()
                self._resealer = Resealer(sealer.keyring, self.records, tiers, data_dir)
            return self._resealer
