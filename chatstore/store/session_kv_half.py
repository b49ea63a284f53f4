"""What the session store does with KV and without it (kv_store = "off"): the two halves
SessionStore (session_store.py) puts behind its records.

`KVHalf` is what differs between the two modes, and nothing else: a turn's KV (opening, ending,
a cut prompt, a prefix match), where a session's KV is, the tiers' reports, and how a read, a
delete, a purge, a shred, a key rotation and a close reach the KV. `NoKV` answers as a store
without KV does (nothing saved, nothing placed, prompts never cut: every turn recomputes);
`StoreKV` asks the KV store (AttentionStore), whose records these are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from chatstore.store.attention_store import AttentionStore
from chatstore.store.ports import KVPlacement, OpenedTurn, TierStats
from chatstore.store.records.base import RecordStore
from chatstore.store.records.record import SessionRecord
from chatstore.store.retention import Retention
from chatstore.store.session_kv import SessionKey
from chatstore.store.tiers.base import StorageTier


class KVHalf(Protocol):
    """The session store's KV half; the port's methods keep their docs (ports.py)."""

    def match_prefix(self, tenant: str, token_ids: list[int]) -> str | None: ...
    def fit_context(
        self, tenant: str, session_id: str, prompt: list[int], head: int, tail: int, reserve: int
    ) -> list[int]: ...
    def open_turn(
        self, tenant: str, session_id: str, prompt_ids: Sequence[int]
    ) -> OpenedTurn | None: ...
    def end_turn(self, turn: OpenedTurn | None) -> None: ...
    def hint(self, tenant: str, session_id: str) -> None: ...
    def placement(self, tenant: str, session_id: str) -> KVPlacement | None: ...
    def kv_location(self, tenant: str, session_id: str) -> str | None: ...
    def tier_stats(self) -> list[TierStats]: ...
    def open_failures(self) -> dict[str, int]: ...
    def remote_health(self) -> dict[str, object] | None: ...
    def flush(self, shared: bool) -> int: ...

    def wait_saved(self, tenant: str, session_id: str) -> None:
        """Before a record is read: the session's pending KV save has landed."""

    def own_model(self, record: SessionRecord) -> SessionRecord:
        """record, its token ids dropped when another model saved them."""

    def retain(self, saved: SessionRecord) -> None:
        """The session's priority and TTL reach the KV placement."""

    def delete(self, key: SessionKey) -> bool: ...
    def purge(self) -> list[SessionKey]: ...

    def shred(self, tenant: str) -> int:
        """Shred the tenant's data keys first, then its sessions with KV (how many)."""

    def reseal_scope(self) -> tuple[list[StorageTier], Path]:
        """The KV tiers a key rotation re-seals, and where it keeps its cursor."""

    def close(self) -> None:
        """The KV and the records (and the data keys, after their last user)."""


class NoKV:
    """kv_store = "off": the records alone."""

    def __init__(self, records: RecordStore, data_dir: Path | None) -> None:
        self.records, self.data_dir = records, data_dir

    def match_prefix(self, tenant: str, token_ids: list[int]) -> str | None:
        return None  # no token ids are saved without KV

    def fit_context(
        self, tenant: str, session_id: str, prompt: list[int], head: int, tail: int, reserve: int
    ) -> list[int]:
        return prompt  # nothing to cut with: the API refuses a prompt that does not fit

    def open_turn(
        self, tenant: str, session_id: str, prompt_ids: Sequence[int]
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

    def tier_stats(self) -> list[TierStats]:
        return []

    def open_failures(self) -> dict[str, int]:
        return {"records": self.records.open_failures}

    def remote_health(self) -> dict[str, object] | None:
        return None

    def flush(self, shared: bool) -> int:
        return 0

    def wait_saved(self, tenant: str, session_id: str) -> None:
        pass  # no pending KV write

    def own_model(self, record: SessionRecord) -> SessionRecord:
        return record  # no token ids kept

    def retain(self, saved: SessionRecord) -> None:
        pass  # no KV placement to tell

    def delete(self, key: SessionKey) -> bool:
        return bool(self.records.delete(key))

    def purge(self) -> list[SessionKey]:
        return self.records.purge_expired()

    def shred(self, tenant: str) -> int:
        sealer = self.records.sealer
        if sealer is not None:
            sealer.keyring.shred(tenant)  # first: nothing of it opens from here on
        return 0

    def reseal_scope(self) -> tuple[list[StorageTier], Path]:
        data_dir = self.data_dir or Path(getattr(self.records, "path", ".")).parent
        return [], data_dir

    def close(self) -> None:
        self.records.close()
        if self.records.sealer is not None:
            self.records.sealer.keyring.store.close()  # the data keys, after their last user


class StoreKV:
    """The KV store behind the records: a read waits for the session's pending save, token ids
    another model saved are blanked, deletes and purges take the KV too, retention reaches
    placement, and the reports read the KV tiers. The device tier (the engine's block pool) is
    not the store's: the API's admin service puts it before these tiers."""

    def __init__(self, kv: AttentionStore) -> None:
        self.kv = kv

    def match_prefix(self, tenant: str, token_ids: list[int]) -> str | None:
        """The records' prefix index, over this model's saved ids."""
        return self.kv.records.match_prefix(tenant, token_ids, self.kv.fingerprint)

    def fit_context(
        self, tenant: str, session_id: str, prompt: list[int], head: int, tail: int, reserve: int
    ) -> list[int]:
        return self.kv.fit_context(tenant, session_id, prompt, head, tail, reserve)

    def open_turn(
        self, tenant: str, session_id: str, prompt_ids: Sequence[int]
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
        return {"records": self.kv.records.open_failures, **self.kv.open_failures()}

    def remote_health(self) -> dict[str, object] | None:
        health = self.kv.stats().remote
        return dataclasses.asdict(health) if health is not None else None

    def flush(self, shared: bool) -> int:
        return self.kv.invalidate_all(shared)

    def wait_saved(self, tenant: str, session_id: str) -> None:
        self.kv.wait_saved(tenant, session_id)

    def own_model(self, record: SessionRecord) -> SessionRecord:
        """The next turn renders the messages afresh rather than feed this model foreign ids."""
        if record.fingerprint != self.kv.fingerprint:
            record.token_ids, record.kv_tokens, record.last_token = [], 0, None
        return record

    def retain(self, saved: SessionRecord) -> None:
        retention = Retention(saved.priority, saved.ttl_s)
        self.kv.set_retention(saved.tenant, saved.session_id, retention)

    def delete(self, key: SessionKey) -> bool:
        return self.kv.delete_session(key.tenant, key.session_id)

    def purge(self) -> list[SessionKey]:
        return self.kv.purge_expired()

    def shred(self, tenant: str) -> int:
        return self.kv.shred_tenant(tenant)  # the store shreds the key first itself

    def reseal_scope(self) -> tuple[list[StorageTier], Path]:
        return list(self.kv.slow_tiers()), self.kv.data_dir

    def close(self) -> None:
        self.kv.close()  # DRAM sessions move to LMDB; the records are closed with it
