"""Finding a session's stored chunks and reading them: from the write buffer (pending turns),
the copies held for opened turns, or the fastest tier (moved up to DRAM).

Inside `foreground()` (the engine's thread) a read is served from host memory only: the write
buffer, the held copies, DRAM (or a chunk on its way down from it). A chunk that only a slow
tier holds (SSD or Redis) reads as None there: the engine's step never waits on a disk or the
network. The turn's opening (turn_opening.py, an API thread) brings such chunks up first; what
it could not is recomputed and prefetched for the next turn.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from chatstore.store.commit.turn_commit import Memo, TurnCommitter
from chatstore.store.opened_turn import OpenedTurn
from chatstore.store.placement.session_placement import SessionPlacement
from chatstore.store.port_values import ChunkDelta, StoredSession
from chatstore.store.session_kv import ChunkKey, SessionKey, SessionKV
from chatstore.store.sessions.index import SessionChain
from chatstore.store.sessions.retention_table import RetentionTable
from chatstore.store.sessions.turn_opening import TurnOpening


class ChunkReader:
    """Thread-safe: the engine thread, the loader's lookup thread and API threads read."""

    def __init__(
        self,
        committer: TurnCommitter,
        fetch: TurnOpening,
        placement: SessionPlacement,
        retention: RetentionTable,
    ) -> None:
        self.committer, self.fetch, self.placement = committer, fetch, placement
        self.retention = retention
        self.tiers, self.index, self.lock = committer.tiers, committer.index, committer.lock
        self.settings = committer.settings
        self._local = threading.local()  # .foreground: reads from host memory only

    @contextmanager
    def foreground(self) -> Iterator[None]:
        """The calling thread's reads, inside, touch no slow tier (see the module's doc)."""
        before = getattr(self._local, "foreground", False)
        self._local.foreground = True
        try:
            with self.tiers.foreground():
                yield
        finally:
            self._local.foreground = before

    def find(self, key: SessionKey, opened: OpenedTurn | None = None) -> StoredSession | None:
        """The session's leading tokens whose chunks are all available (stored in a tier or
        waiting in the write buffer). No KV is read. An expired session reads as absent (the
        purge timer deletes it: not here, on the engine thread). A session without a chain
        finds the stored prefix its opened turn's prompt borrowed (`opened.borrowed`)."""
        self.fetch.ensure(key)  # a session the index restore has not reached yet
        with self.lock:
            chain = self.index.get(key)
            if chain is None and opened is not None and opened.borrowed is not None:
                chain = SessionChain(opened.borrowed.token_ids, opened.borrowed.chunks)
            if chain is None or self.expired(key, chain):
                self.tiers.counters.misses += 1
                return None
            self.placement.tell("touch", key)
        n = 0
        for chunk in chain.chunks:
            if not (self.committer.has_chunk(chunk) or chunk in self.fetch.held):
                break
            n += 1
        C = self.settings.chunk_tokens
        tokens = list(chain.token_ids[: min(len(chain.token_ids), n * C)])
        return StoredSession(key, tokens, chain.chunks[:n], C)

    def prepare_load(self, key: SessionKey, opened: OpenedTurn | None) -> StoredSession | None:
        """find, with the tier each chunk was in when the turn opened (the handle's note), or
        is in now for a chunk it did not note or a turn the API did not open (a chunk gone by
        now: host memory, the read buffer's), and the session's version read before it."""
        version = self.committer.versions.get(key)
        stored = self.find(key, opened)
        if stored is None:
            return None
        noted = opened.origins if opened is not None else {}
        origins = {c: noted.get(c) or self.fetch.chunk_tier(c) or "dram" for c in stored.chunks}
        C = stored.chunk_tokens
        served = StoredSession(key, stored.token_ids, stored.chunks, C, origins, version)
        if opened is not None:
            opened.served = served  # the reply splits its cached tokens by these origins
        return served

    def expired(self, key: SessionKey, chain: SessionChain) -> bool:
        ttl = self.retention.get(key).ttl(self.settings.session_ttl_s)
        return ttl > 0 and chain.updated_at + ttl < time.time()

    def read(
        self,
        keys: list[ChunkKey],
        count: bool = True,
        rows: Sequence[tuple[int, int] | None] | None = None,
    ) -> list[SessionKV | None]:
        """count: a load (hits and misses counted), not a re-read; rows: per chunk, only rows
        [start, end) (None: all). In `foreground()`: host memory only."""
        memory_only = getattr(self._local, "foreground", False)
        out: list[SessionKV | None] = []
        for i, key in enumerate(keys):
            span = rows[i] if rows is not None else None
            memo = self.committer.pending.get(key)
            value = self._pending_value(memo, key) if memo is not None else self.fetch.held.get(key)
            if value is not None:
                if count:
                    self.tiers.count_pending_hit(key)
                if span is not None:
                    value = SessionKV(
                        value.token_ids[span[0] : span[1]], value.kv[:, :, span[0] : span[1]]
                    )
                out.append(value)
            elif memory_only:
                out.append(self._in_memory(key, count, span))
            else:
                out.append(self.tiers.get(key, count=count, rows=span))
        return out

    def _in_memory(
        self, key: ChunkKey, count: bool, span: tuple[int, int] | None
    ) -> SessionKV | None:
        """key's chunk from DRAM (or on its way down from it), else None: no slow tier is
        read. Under the tiers' lock, so that no eviction moves it down between the two."""
        tiers = self.tiers
        with tiers.lock:
            if tiers.top is None or tiers.where(key) != tiers.top.name:
                return None
            return tiers.get(key, count=count, rows=span)

    def _pending_value(self, memo: Memo, key: ChunkKey) -> SessionKV | None:
        """A chunk still in the write buffer, whole (a delta joined to its base); None if
        its base is gone, which means the turn has just landed (read the tiers)."""
        value = memo()[key]
        if not isinstance(value, ChunkDelta):
            return value
        base = self.read([value.base], count=False)[0]
        if base is None:
            return None
        kv = torch.cat([base.kv[:, :, : value.keep], value.rows.kv.to(base.dtype)], dim=2)
        return SessionKV(base.token_ids[: value.keep] + value.rows.token_ids, kv)

    def whole(self, key: SessionKey) -> SessionKV | None:
        """The session's whole stored KV in one tensor (tools and tests)."""
        stored = self.find(key)
        if stored is None or not stored.chunks:
            return None
        values = self.read(stored.chunks)
        if any(v is None for v in values):
            return None
        kv = torch.cat([v.kv for v in values if v is not None], dim=2)
        return SessionKV(list(stored.token_ids), kv)
