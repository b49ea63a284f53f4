"""The one small interface the API needs from the session store.

A session's record is the store's own `SessionRecord` (chatstore.store.records: tenant,
messages, the token ids whose KV is saved, kv_tokens / last_token of the last turn, retention,
timestamps); the KV itself moves between engine and store through the engine's KVConnector, out
of the API's sight. `StoreAdapter` (store_adapter.py) implements this port over chatstore.store.
"""

from __future__ import annotations

import builtins
from dataclasses import dataclass, field
from typing import Any, Protocol

from chatstore.engine.kv_connector import KVConnector
from chatstore.store.records import ResponseRecords, SessionLease, SessionRecord

__all__ = [
    "DEVICE_TIER",
    "INTERNAL_TENANT_PREFIX",
    "SessionPlacement",
    "SessionRecord",
    "SessionStorePort",
    "TierStats",
    "store_hits",
]

# Tenants starting with a NUL were the server's own namespaces (stored Responses, before they
# had a namespace of their own): no configured tenant can hold a NUL, so users never see them.
INTERNAL_TENANT_PREFIX = "\x00"


@dataclass(frozen=True)
class SessionPlacement:
    """Where a session's stored KV is: tokens per tier (each chunk at its fastest tier)."""

    tokens_by_tier: dict[str, int]
    bytes_per_token: int

    @property
    def tokens(self) -> int:
        return sum(self.tokens_by_tier.values())

    @property
    def bytes_by_tier(self) -> dict[str, int]:
        return {t: n * self.bytes_per_token for t, n in self.tokens_by_tier.items()}


@dataclass(frozen=True)
class TierStats:
    """One tier's line. The device tier is the engine's block pool and prefix cache, counted
    by the engine (`device_tier` in store_adapter.py): its hits and misses are full prompt
    blocks, the store tiers' are chunk reads."""

    name: str  # device | dram | ssd | remote
    capacity_bytes: int
    used_bytes: int
    sessions: int
    hits: int
    misses: int
    bytes_up: int  # moved towards the device (loads, prefetches)
    bytes_down: int  # moved away from the device (saves, demotions)
    evictions: int
    prefetches: int
    # Writes into this tier it did not take, by reason: map_full / disk_full (its LMDB map or
    # disk is full: the chunk stays in DRAM and the write-back retries), error (it raised).
    write_failures_by_reason: dict[str, int] = field(default_factory=dict)

    @property
    def write_failures(self) -> int:
        return sum(self.write_failures_by_reason.values())

    @property
    def hit_rate(self) -> float | None:
        total = self.hits + self.misses
        return self.hits / total if total else None


DEVICE_TIER = "device"


def store_hits(tiers: list[TierStats]) -> tuple[int, int]:
    """Hits and misses of the store's tiers, the overall hit rate's terms. The device tier's
    are left out: a prompt block missed on the device and then read from DRAM would count as
    one miss and one hit, and the device counts blocks where the store counts chunks."""
    store = [t for t in tiers if t.name != DEVICE_TIER]
    return sum(t.hits for t in store), sum(t.misses for t in store)


class SessionStorePort(Protocol):
    @property
    def connector(self) -> KVConnector | None: ...

    @property
    def responses(self) -> ResponseRecords:
        """The stored Responses (their own records; blocking calls)."""
        ...

    def get(self, tenant: str, session_id: str) -> SessionRecord | None:
        """The live record, with token_ids empty when another model saved them."""
        ...

    def create(self, record: SessionRecord) -> bool:
        """Write a new session's record; False when the id is taken."""
        ...

    def append_turn(
        self,
        record: SessionRecord,
        new_messages: list[dict[str, Any]],
        keep: int | None = None,
        kv_tokens: int = 0,
        last_token: int | None = None,
    ) -> None:
        """Append a turn's messages on top of `record.version`, keeping the first `keep` stored
        messages (None: all), with the turn's kv_tokens / last_token (0 / None: the next turn
        renders afresh); raises RecordConflict when the session changed meanwhile. `record`
        becomes what was stored."""
        ...

    def acquire_lease(self, tenant: str, session_id: str) -> SessionLease | None:
        """The session's lease for one turn or delete (shared by replicas); None when another
        replica holds it. Raises RecordStoreUnavailable when the store cannot be reached."""
        ...

    def release_lease(self, lease: SessionLease, wait: bool = True) -> None: ...

    def delete(self, tenant: str, session_id: str) -> bool:
        """Forget the record and its KV in every tier; False when it did not exist."""
        ...

    def update(self, tenant: str, session_id: str, **changes: Any) -> SessionRecord | None:
        """Change a session's priority, ttl_s or metadata; None when it does not exist."""
        ...

    def placement(self, tenant: str, session_id: str) -> SessionPlacement | None:
        """Where the session's KV is now; None without a store."""
        ...

    def count_sessions(self, tenant: str) -> int: ...

    def purge_expired(self) -> int:
        """Delete the sessions idle past the TTL (records and KV); how many went."""
        ...

    def list(
        self, tenant: str | None, offset: int, limit: int
    ) -> tuple[builtins.list[SessionRecord], int]:
        """One page of a tenant's sessions (all tenants for None), newest first, and the total."""
        ...

    def match_prefix(self, tenant: str, token_ids: builtins.list[int]) -> str | None:
        """The tenant's session whose saved tokens share the longest prefix with token_ids."""
        ...

    def kv_location(self, tenant: str, session_id: str) -> str | None: ...

    def fit_context(
        self,
        tenant: str,
        session_id: str,
        prompt: builtins.list[int],
        head: int,
        tail: int,
        reserve: int,
    ) -> builtins.list[int]:
        """The prompt cut so that it plus `reserve` reply tokens fit the context window (the
        oldest history after `head` tokens dropped, the last `tail` kept), the session's saved
        KV cut the same way."""
        ...

    def tier_stats(self) -> builtins.list[TierStats]: ...

    def fetch_remote(self, tenant: str, session_id: str) -> None:
        """Before a turn: bring what only the remote tier holds up to a local tier."""
        ...

    def prefetch(self, tenant: str, session_id: str) -> None:
        """Hint: this session will run soon (its client is typing)."""
        ...

    def open_failures(self) -> dict[str, int]:
        """Stored values that failed to open (encryption at rest), per slow tier and records."""
        ...

    def remote_health(self) -> dict[str, Any] | None:
        """The remote (Redis) tier's circuit breaker; None without a remote tier."""
        ...

    def rotate_keys(self) -> dict[str, Any] | None:
        """Start (or resume) re-sealing every stored value under the newest key; its progress.
        None: encryption at rest is off."""
        ...

    def rotation_progress(self) -> dict[str, Any] | None: ...

    def shred_tenant(self, tenant: str) -> dict[str, int]:
        """Crypto-shred tenant (its key, then its sessions, KV and stored Responses); how many
        of each went."""
        ...

    def flush(self) -> int:
        """Drop all cached session KV (records stay); the number of sessions dropped."""
        ...

    def close(self) -> None:
        """Persist what must survive a restart, then release the tiers."""
        ...
