"""The store's contract, in one screen: the protocols the rest of chatstore codes against, and
(re-exported from port_values.py) the typed values that cross them. `AttentionStore`
implements every protocol here (mypy checks it); code outside `chatstore/store/` types the
store as one of them, not as the class.

    engine ──(QueueLookahead)──► store          the look-ahead: who runs next
    transfer ──(KVSource)────► store          find, read, plan and save a turn's chunks
    api ──(SessionKVAdmin)───► store          records, leases, turns' contexts, KV admin, reports
    kv_events ──(ChunkCatalog)► store         stored chunks per tier and their events

One turn's handle, `OpenedTurn` (opened_turn.py), goes api -> engine Request -> transfer -> api:
open_turn, prepare_load / load_history, save_turn, append_turn, end_turn.

`SessionKVAdmin` is session_store.py's SessionStore: the records, with the KV store (the facade,
AttentionStore) behind them or none (kv_store = "off"). The API and transfer import from
chatstore.store this module and plain value modules (the records' value types and errors are
re-exported here; retention's limits, encryption's errors and DRAM rows read in place are in
their own leaf modules). Importing this module loads only its values
(tests/test_package_layout.py pins how few).

Threads. Every method is thread-safe unless its docstring names a thread. The engine thread
never waits on the network, a disk or a pending write: its reads (`load_history`) touch host
memory only (no SSD, no remote tier), and the methods that may wait (`open_turn`,
`delete_session`, `purge_expired`, `wait_saved`, ...) are for the API's worker threads.
Listeners and hint listeners are called on the thread that caused the event: keep them short,
never call back into the store from one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from chatstore.store.opened_turn import BorrowedPrefix, OpenedTurn, TurnChain
from chatstore.store.port_values import (
    DEVICE_TIER,
    ChunkBuilder,
    ChunkDelta,
    ChunkText,
    ContextBudget,
    EventKind,
    HistoryRead,
    KVPlacement,
    Listener,
    StoredSession,
    StoreEvent,
    TierStats,
    TurnPlan,
    TurnPreparer,
    store_hits,
)
from chatstore.store.records.record import (
    ChainRecord,
    RecordConflict,
    RecordStoreError,
    RecordStoreFull,
    RecordStoreUnavailable,
    SessionLease,
    SessionRecord,
)
from chatstore.store.records.responses import ResponseExists, ResponseRecord, ResponseRecords
from chatstore.store.session_kv import ChunkKey, SessionKey, SessionKV

HintListener = Callable[[str, str], object]  # (tenant, session_id)


# -- what the store consumes -----------------------------------------------------------------


class WaitingSession(Protocol):
    """One queued request as the look-ahead sees it (the engine's `WaitingEntry`)."""

    @property
    def request_id(self) -> str: ...
    @property
    def tenant(self) -> str: ...
    @property
    def session_id(self) -> str | None: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def started(self) -> bool:
        """Part of it is computed already (its KV is in the device pool)."""


class QueueLookahead(Protocol):
    """The scheduler's waiting queue (the engine's `AsyncEngine`): a thread-safe snapshot in
    admission order, soonest first. Placement's look-ahead and the prefetch thread read it."""

    def waiting_sessions(self, limit: int | None = None) -> Sequence[WaitingSession]:
        """The requests of the first `limit` queued sequences (all when None)."""


# -- what the store offers ---------------------------------------------------------------------


class KVSource(Protocol):
    """What moves KV between the engine and the store (chatstore/transfer/) uses."""

    @property
    def chunk_tokens(self) -> int: ...
    @property
    def storage_dtype(self) -> torch.dtype: ...
    @property
    def bytes_per_token(self) -> int: ...

    def find(
        self, tenant: str, session_id: str, opened: OpenedTurn | None = None
    ) -> StoredSession | None:
        """The session's stored history (no KV read); None when none; with `opened`, a
        session without a chain finds the prefix its turn borrowed. Engine or loader thread."""

    def prepare_load(
        self, tenant: str, session_id: str, opened: OpenedTurn | None
    ) -> StoredSession | None:
        """`find` at a turn's admission (engine thread), with each chunk's tier as the turn
        found when it opened (`opened`, the handle the request carries; None: a turn the API
        did not open, the tiers as they are now)."""

    def version(self, tenant: str, session_id: str) -> int:
        """Changes whenever the session's KV may have; read it before `find`."""

    def read_chunks(
        self,
        keys: list[ChunkKey],
        count: bool = True,
        rows: Sequence[tuple[int, int] | None] | None = None,
    ) -> list[SessionKV | None]:
        """The chunks' KV (None: gone), from any tier; rows: per chunk, only rows [start, end).
        The loader's threads (a staged session, a load re-read after a preemption)."""

    def load_history(
        self, stored: StoredSession, start: int, end: int, opened: OpenedTurn | None
    ) -> HistoryRead:
        """A turn's admission read of `stored`'s positions [start, end) on the engine thread:
        from host memory only (write buffer, held copies, DRAM), never a disk or the network,
        up to the first chunk that is gone or only below (SSD, Redis: the session is then
        prefetched to DRAM for its next turn, not waited for). The turn's pins (`opened`) go
        once read."""

    def save_turn(
        self,
        tenant: str,
        session_id: str,
        token_ids: list[int],
        stored: StoredSession | None,
        reusable: int,
        prepare: TurnPreparer,
        opened_at: float | None = None,
        opened: OpenedTurn | None = None,
    ) -> None:
        """Make token_ids' chain the session's history (its first `reusable` are `stored`'s):
        the store plans the chain (TurnPlan: which chunks are new, which extend a stored one)
        and `prepare(plan)` answers the builder of the new chunks and their bytes; `build()`
        runs once (on the writer thread with async_save). Engine thread; returns once a
        `find` sees the new chain. A session deleted after `opened_at` (monotonic; `opened`'s
        when given) keeps nothing. The commit completes `opened.chain` (the API records it
        with the turn's messages)."""

    def yield_to(self, idle: threading.Event) -> None:
        """Background writes wait while `idle` is clear (a prefill runs). Once, at start."""

    def add_hint_listener(self, listener: HintListener) -> None:
        """Also told of every client hint (`SessionKVAdmin.hint`): the read buffer stages it."""


class SessionKVAdmin(Protocol):
    """The API's whole view of the session store: records, leases, a turn's context, KV admin,
    reports. Blocking calls (the API's worker threads) unless a docstring says otherwise."""

    @property
    def context(self) -> ContextBudget: ...
    @property
    def responses(self) -> ResponseRecords:
        """The stored Responses (their own records)."""

    def get(self, tenant: str, session_id: str) -> SessionRecord | None:
        """The live record (after its pending save), token ids empty when another model saved
        them (the next turn renders the messages afresh)."""

    def create(self, record: SessionRecord) -> bool:
        """Write a new session's record; False when the id is taken."""

    def update(self, tenant: str, session_id: str, **changes: object) -> SessionRecord | None:
        """Change a session's priority, ttl_s or metadata; None when it does not exist."""

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
        """Append a turn's messages on top of `record.version`, keeping the first `keep` stored
        messages (None: all), with the KV chain the turn's commit made (`turn`, as `open_turn`
        gave it); RecordConflict when the session changed meanwhile. `record` becomes what was
        stored. Then `lease` goes back, written or not (the lease guarded this write: the
        client's next turn may go to another replica)."""

    def acquire_lease(self, tenant: str, session_id: str) -> SessionLease | None:
        """The session's lease for one turn or delete (shared by replicas); None when another
        replica holds it. RecordStoreUnavailable when the store cannot be reached."""

    def release_lease(self, lease: SessionLease, wait: bool = True) -> None:
        """wait=False: returns at once (the event loop), the release goes out behind."""

    def delete(self, tenant: str, session_id: str) -> bool:
        """Forget the record and its KV in every tier; False when it did not exist."""

    def list_sessions(
        self, tenant: str | None, offset: int, limit: int
    ) -> tuple[list[SessionRecord], int]:
        """One page of a tenant's sessions (every user tenant's for None), newest first, and
        the total."""

    def count_sessions(self, tenant: str) -> int: ...
    def purge_expired(self) -> int:
        """Delete the sessions idle past their TTL (records and KV); how many went."""

    def match_prefix(self, tenant: str, token_ids: list[int]) -> str | None:
        """The tenant's session whose saved tokens (this model's) share the longest prefix."""

    def fit_context(
        self, tenant: str, session_id: str, prompt: list[int], head: int, tail: int, reserve: int
    ) -> list[int]:
        """The prompt cut so that it and `reserve` reply tokens fit `context` (the oldest
        history after `head` tokens dropped, the last `tail` kept), the saved KV cut alike; a
        ValueError when it cannot fit. Records only: the prompt whole (nothing to cut with)."""

    def open_turn(
        self, tenant: str, session_id: str, prompt_ids: Sequence[int] = ()
    ) -> OpenedTurn | None:
        """Before a turn: what only SSD or the remote tier holds of the session's KV, or of
        the stored chunks its prompt (`prompt_ids`) begins with, comes up to host memory and
        stays pinned there until the engine has read it. The handle rides on the engine's
        Request (`store_turn`) and ends with `end_turn`. None: records only, no KV."""

    def end_turn(self, turn: OpenedTurn | None) -> None:
        """The turn is over, whatever happened (the event loop: returns at once): its pins go,
        and a chain its commit made that no append took is recorded by the store."""

    def hint(self, tenant: str, session_id: str) -> None:
        """The client is typing: the session's KV moves up. Returns at once."""

    def placement(self, tenant: str, session_id: str) -> KVPlacement | None:
        """Where the session's KV is now; None without KV."""

    def kv_location(self, tenant: str, session_id: str) -> str | None: ...
    def tier_stats(self) -> list[TierStats]:
        """The store's tiers, fastest first (none without KV)."""

    def open_failures(self) -> dict[str, int]:
        """Stored values that failed to open, per slow tier and `records`."""

    def remote_health(self) -> dict[str, object] | None:
        """The remote (Redis) tier's circuit breaker; None without one."""

    def rewrap_keys(self) -> int | None:
        """Master-key rotation: wrap every tenant's data keys by the newest master key (no
        value is touched); how many tenants changed. None: encryption at rest is off."""

    def rotate_keys(self, job: str = "data-keys") -> dict[str, object] | None:
        """Start (or resume) a background job over every stored value, "data-keys" (new data
        keys, re-seal, retire the old), "encrypt-existing" (seal clear values) or "migrate-v1"
        (re-seal records sealed before envelope keys); its progress. None: encryption at rest
        is off."""

    def rotation_progress(self) -> dict[str, object] | None: ...
    def shred_tenant(self, tenant: str) -> dict[str, int]:
        """Crypto-shred tenant (its key, then its sessions, KV, Responses); how many went."""

    def flush(self, shared: bool = False) -> int:
        """Drop this replica's cached session KV (records stay); how many sessions. With
        `shared`, every chunk of the model in the shared tier (Redis) too, for every replica."""

    def close(self) -> None:
        """Persist what must survive a restart, then release the tiers and records."""


class ChunkCatalog(Protocol):
    """What the KV events publisher (chatstore/kv_events/) reads: chunks, not sessions."""

    @property
    def chunk_tokens(self) -> int: ...

    def add_listener(self, listener: Listener) -> None:
        """Told of every StoreEvent (keyed by ChunkKey), on the thread that caused it."""

    def chunks_by_tier(self) -> dict[str, list[ChunkKey]]:
        """Every stored chunk, by the tier holding it (a chunk may be in several)."""

    def describe_chunk(self, key: ChunkKey) -> ChunkText | None:
        """A full chunk some session holds: its tokens and parent; None otherwise."""


__all__ = [
    "DEVICE_TIER",
    "BorrowedPrefix",
    "ChainRecord",
    "ChunkBuilder",
    "ChunkCatalog",
    "ChunkDelta",
    "ChunkKey",
    "ChunkText",
    "ContextBudget",
    "EventKind",
    "HintListener",
    "HistoryRead",
    "KVPlacement",
    "KVSource",
    "Listener",
    "OpenedTurn",
    "QueueLookahead",
    "RecordConflict",
    "RecordStoreError",
    "RecordStoreFull",
    "RecordStoreUnavailable",
    "ResponseExists",
    "ResponseRecord",
    "ResponseRecords",
    "SessionKV",
    "SessionKVAdmin",
    "SessionKey",
    "SessionLease",
    "SessionRecord",
    "StoreEvent",
    "StoredSession",
    "TierStats",
    "TurnChain",
    "TurnPlan",
    "TurnPreparer",
    "WaitingSession",
    "store_hits",
]
