"""The store's contract, in one screen: the typed values that cross its edge and the protocols
the rest of chatstore codes against. `AttentionStore` implements every protocol here (mypy
checks it); code outside `chatstore/store/` types the store as one of them, not as the class.

    engine ──(WaitingQueue)──► store          the look-ahead: who runs next
    transfer ──(KVSource)────► store          find, read, plan and save a turn's chunks
    api ──(SessionKVAdmin)───► store          open a turn, cut a context, retention, deletes
    kv_events ──(ChunkCatalog)► store         stored chunks per tier and their events

Threads. Every method is thread-safe unless its docstring names a thread. The engine thread
never waits on the network or on a pending write: it reads inside `foreground_reads()` (no
remote tier there), and the methods that may wait (`fetch_remote`, `delete_session`,
`purge_expired`, `wait_saved`, ...) are for the API's worker threads. Listeners and hint
listeners are called on the thread that caused the event: keep them short, never call back
into the store from one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol

import torch

from chatstore.store.chunks.keys import ChunkKey, chunk_span, tokens_by_tier
from chatstore.store.events import EventKind, Listener, StoreEvent, StoreStats
from chatstore.store.records import RecordStore
from chatstore.store.retention import Retention
from chatstore.store.session_kv import SessionKey, SessionKV
from chatstore.store.sessions.holds import TurnHold
from chatstore.store.tiers.base import StorageTier

# -- values ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredSession:
    """What the store holds of a session: its leading tokens whose chunks are all stored.
    `origins`: the tier each chunk was in when the turn opened (`admit` only; else empty)."""

    key: SessionKey
    token_ids: list[int]
    chunks: list[ChunkKey]
    chunk_tokens: int
    origins: Mapping[ChunkKey, str] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def span(self, index: int) -> tuple[int, int]:
        return chunk_span(index, self.chunk_tokens, len(self.token_ids))

    def tokens_by_origin(self, start: int, end: int) -> dict[str, int]:
        """Tokens [start, end) counted by the tier their chunk was in when the turn opened."""
        return tokens_by_tier(self.chunks, self.chunk_tokens, start, end, self.origins.get)


@dataclass(frozen=True)
class ChunkDelta:
    """A new chunk given as the first `keep` rows of the stored chunk `base` + `rows`."""

    base: ChunkKey
    keep: int
    rows: SessionKV  # the rows after the kept ones (token ids and KV)


@dataclass(frozen=True)
class TurnPlan:
    """A turn's chain (chunks/plan.py) and which of its chunks are new; `bases`: new chunk ->
    (the stored chunk it extends, rows it keeps of it)."""

    token_ids: list[int]
    chain: list[ChunkKey]
    new_chunks: tuple[ChunkKey, ...]
    chunk_tokens: int
    bases: dict[ChunkKey, tuple[ChunkKey, int]] = field(default_factory=dict)

    def span(self, index: int) -> tuple[int, int]:
        return chunk_span(index, self.chunk_tokens, len(self.token_ids))

    def new_spans(self) -> list[tuple[int, ChunkKey, int, int]]:
        """(chain index, key, start, end) of every new chunk."""
        new = set(self.new_chunks)
        return [(i, k, *self.span(i)) for i, k in enumerate(self.chain) if k in new]


class KVPlacement(NamedTuple):
    """Where a session's stored KV is: tokens per tier (each chunk at its fastest tier)."""

    tokens_by_tier: dict[str, int]
    bytes_per_token: int


class ChunkText(NamedTuple):
    """A full stored chunk's token ids and the chunk before it in its chain (None: first)."""

    token_ids: list[int]
    parent: ChunkKey | None


ChunkBuilder = Callable[[], Mapping[ChunkKey, SessionKV | ChunkDelta]]
HintListener = Callable[[str, str], object]  # (tenant, session_id)


# -- what the store consumes -----------------------------------------------------------------


class WaitingSession(Protocol):
    """One queued request as the look-ahead sees it (the engine's `WaitingEntry`)."""

    @property
    def tenant(self) -> str: ...
    @property
    def session_id(self) -> str | None: ...
    @property
    def num_prompt_tokens(self) -> int: ...


class WaitingQueue(Protocol):
    """The scheduler's waiting queue (the engine's `AsyncEngine`): a thread-safe snapshot in
    admission order, soonest first. Placement's look-ahead and the prefetch thread read it."""

    def waiting_sessions(self) -> Sequence[WaitingSession]: ...


# -- what the store offers ---------------------------------------------------------------------


class KVSource(Protocol):
    """What moves KV between the engine and the store (chatstore/transfer/) uses."""

    @property
    def chunk_tokens(self) -> int: ...
    @property
    def storage_dtype(self) -> torch.dtype: ...
    @property
    def bytes_per_token(self) -> int: ...

    def find(self, tenant: str, session_id: str) -> StoredSession | None:
        """The session's stored history (no KV read); None when none. Engine or loader thread."""

    def admit(self, tenant: str, session_id: str) -> StoredSession | None:
        """`find` at a turn's admission, with each chunk's tier as the turn found it (taken
        once: a second admit of the same turn sees the tiers as they are now)."""

    def version(self, tenant: str, session_id: str) -> int:
        """Changes whenever the session's KV may have; read it before `find`."""

    def read_chunks(
        self,
        keys: list[ChunkKey],
        count: bool = True,
        rows: Sequence[tuple[int, int] | None] | None = None,
    ) -> list[SessionKV | None]:
        """The chunks' KV (None: gone); rows: per chunk, only rows [start, end)."""

    def foreground_reads(self) -> AbstractContextManager[None]:
        """The engine thread's reads: no remote tier inside (a miss there, not a wait)."""

    def remote_only(self, chunk: ChunkKey) -> bool:
        """Only the remote tier holds the chunk (a foreground read cannot reach it)."""

    def prefetch(self, tenant: str, session_id: str) -> None:
        """Move the session's chunks up to DRAM on the prefetch thread; returns at once."""

    def take_hold(self, tenant: str, session_id: str) -> TurnHold | None:
        """The opened turn's hold (`fetch_remote`), the engine thread's to release once read."""

    def release_hold(self, hold: TurnHold | None) -> None:
        """Unpin the hold's chunks (any thread; a second release does nothing)."""

    def plan_turn(
        self, tenant: str, token_ids: list[int], stored: StoredSession | None, reusable: int
    ) -> TurnPlan:
        """token_ids' chain (the first `reusable` are `stored`'s) and its new chunks."""

    def save_turn(
        self,
        tenant: str,
        session_id: str,
        plan: TurnPlan,
        build: ChunkBuilder,
        nbytes: int,
        opened_at: float | None = None,
    ) -> None:
        """Make plan's chain the session's history; `build()` runs once (on the writer thread
        with async_save). Engine thread; returns once a `find` sees the new chain."""

    def yield_to(self, idle: threading.Event) -> None:
        """Background writes wait while `idle` is clear (a prefill runs). Once, at start."""

    def add_hint_listener(self, listener: HintListener) -> None:
        """Also told of every client hint (`SessionKVAdmin.hint`): the read buffer stages it."""


class SessionKVAdmin(Protocol):
    """What the API uses: opening turns, cutting contexts, retention, deletes, reports."""

    @property
    def max_context_tokens(self) -> int: ...
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

    def fetch_remote(self, tenant: str, session_id: str) -> int:
        """Open a turn (API worker thread, before the engine queues it): chunks only Redis
        holds come up and are held until the engine reads them; how many came up."""

    def fit_context(
        self, tenant: str, session_id: str | None, prompt_ids: list[int], head: int, tail: int
    ) -> list[int]:
        """The prompt cut to `max_context_tokens` (the session's chain loses the same chunks)."""

    def set_retention(self, tenant: str, session_id: str, retention: Retention) -> None: ...
    def kv_by_tier(self, tenant: str, session_id: str) -> dict[str, int]: ...
    def placement(self, tenant: str, session_id: str) -> KVPlacement: ...
    def tier_of(self, tenant: str, session_id: str) -> str | None:
        """The slowest tier holding a chunk of the session (waits for its pending write)."""

    def wait_saved(self, tenant: str, session_id: str, timeout: float = ...) -> bool: ...
    def delete_session(self, tenant: str, session_id: str) -> bool: ...
    def purge_expired(self) -> list[SessionKey]: ...
    def shred_tenant(self, tenant: str) -> int: ...
    def invalidate_all(self) -> int: ...
    def slow_tiers(self) -> Sequence[StorageTier]:
        """The sealed tiers (SSD, remote), for the key rotation's re-seal."""

    def stats(self) -> StoreStats: ...
    def close(self, flush_dram: bool = True) -> None: ...


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
    "ChunkBuilder",
    "ChunkCatalog",
    "ChunkDelta",
    "ChunkKey",
    "ChunkText",
    "EventKind",
    "HintListener",
    "KVPlacement",
    "KVSource",
    "Listener",
    "SessionKV",
    "SessionKVAdmin",
    "SessionKey",
    "StoreEvent",
    "StoreStats",
    "StoredSession",
    "TurnHold",
    "TurnPlan",
    "WaitingQueue",
    "WaitingSession",
]
