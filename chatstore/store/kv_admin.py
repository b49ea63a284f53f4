"""What the session store (session_store.py) uses of the KV store (the facade, AttentionStore):
opening turns, cutting contexts, retention, deletes, reports. Inside chatstore/store/ only: the
API sees the session store through ports.SessionKVAdmin."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from chatstore.store.events import StoreStats
from chatstore.store.ports import ContextBudget, KVPlacement, OpenedTurn, WaitingQueue
from chatstore.store.records.base import RecordStore
from chatstore.store.retention import Retention
from chatstore.store.session_kv import SessionKey
from chatstore.store.tiers.base import StorageTier


class KVAdmin(Protocol):
    """What the session store (session_store.py) uses of the KV store: opening turns, cutting
    contexts, retention, deletes, reports."""

    @property
    def context(self) -> ContextBudget: ...
    @property
    def bytes_per_token(self) -> int: ...
    @property
    def session_lease_s(self) -> float: ...
    @property
    def replica_id(self) -> str: ...
    @property
    def data_dir(self) -> Path: ...
    @property
    def fingerprint(self) -> str:
        """The model's: KV saved by another model is not reused (its token ids are not ours)."""

    @property
    def records(self) -> RecordStore:
        """The session records the store writes each turn's chunk list into (records/)."""

    def set_waiting_queue(self, queue: WaitingQueue) -> None:
        """The engine's queue, for look-ahead placement; starts the prefetch thread. Once."""

    def hint(self, tenant: str, session_id: str) -> None:
        """A client's hint that the session runs soon (typing, POST prefetch): its chunks move
        up to DRAM and hint listeners (the read buffer) stage it. Returns at once."""

    def open_turn(
        self,
        tenant: str,
        session_id: str,
        prompt_ids: Sequence[int] = (),
        records_turn: bool = False,
    ) -> OpenedTurn:
        """Open a turn (API worker thread, before the engine queues it): chunks only SSD or
        Redis holds come up and are pinned until the engine reads them; a session without a
        stored chain borrows the stored chunks its prompt's leading full chunks hash to (a
        shared system prompt, whichever replica stored it). records_turn: the caller records
        the turn's chain (the handle's TurnChain) with its messages."""

    def end_turn(self, opened: OpenedTurn | None) -> None:
        """The turn is over (see ports.SessionKVAdmin.end_turn)."""

    def fit_context(
        self,
        tenant: str,
        session_id: str | None,
        prompt_ids: list[int],
        head: int,
        tail: int,
        reserve: int = 0,
    ) -> list[int]:
        """The prompt cut so that it and `reserve` reply tokens fit `context` (the session's
        chain loses the same chunks); ContextOverflowError (a ValueError) when it cannot."""

    def set_retention(self, tenant: str, session_id: str, retention: Retention) -> None: ...
    def kv_by_tier(self, tenant: str, session_id: str) -> dict[str, int]: ...
    def placement(self, tenant: str, session_id: str) -> KVPlacement: ...
    def tier_of(self, tenant: str, session_id: str) -> str | None:
        """The slowest tier holding a chunk of the session (waits for its pending write)."""

    def wait_saved(self, tenant: str, session_id: str, timeout: float = ...) -> bool: ...
    def delete_session(self, tenant: str, session_id: str) -> bool: ...
    def purge_expired(self) -> list[SessionKey]: ...
    def shred_tenant(self, tenant: str) -> int: ...
    def invalidate_all(self, shared: bool = False) -> int: ...
    def slow_tiers(self) -> Sequence[StorageTier]:
        """The sealed tiers (SSD, remote), for the key rotation's re-seal."""

    def stats(self) -> StoreStats: ...
    def open_failures(self) -> dict[str, int]:
        """Stored chunks that failed to open (encryption at rest), per slow tier."""

    def close(self, flush_dram: bool = True) -> None: ...
