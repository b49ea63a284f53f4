"""Sessions as the placement policy sees them: uses, departures and priorities told to it, the
engine's waiting queue as its look-ahead, and the prefetch thread's candidates.

The session policy is also read by evictions, under the tiers' lock: every call into it takes
that lock (after the store's, never before).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any

from chatstore.store.ports import QueueLookahead
from chatstore.store.session_kv import SessionKey
from chatstore.store.sessions.index import SessionIndex
from chatstore.store.tiers.chunk_tiers import ChunkTiers


class SessionPlacement:
    """The chooser (a PolicyChooser, or a custom one: its hooks are optional) over the index.
    `tiers` is set once the tiers exist (they take the chooser, through ChunkPlacement)."""

    def __init__(self, index: SessionIndex) -> None:
        self.index = index
        self.chooser: Any = None
        self._tiers: ChunkTiers | None = None
        self._queue: QueueLookahead | Callable[[], Iterable[SessionKey]] | None = None

    @property
    def tiers(self) -> ChunkTiers | None:
        return self._tiers

    @tiers.setter
    def tiers(self, tiers: ChunkTiers | None) -> None:
        """Once the tiers exist, their chunk placement follows this index's owners (so an
        eviction need not rank every owner of a chunk: chunk_placement.py)."""
        self._tiers = tiers
        follow = getattr(tiers.placement, "follow", None) if tiers is not None else None
        if follow is not None:
            follow(self.index)

    def set_queue(self, queue: QueueLookahead | Callable[[], Iterable[SessionKey]]) -> None:
        """The engine's QueueLookahead; or, where no engine runs (tests, a trace replay), a
        callable giving the queued session keys soonest first."""
        self._queue = queue

    def queued(self) -> list[SessionKey]:
        """The waiting queue's sessions, soonest first (repeats kept: one per queued job)."""
        queue = self._queue
        if queue is None:
            return []
        waiting_sessions = getattr(queue, "waiting_sessions", None)
        if waiting_sessions is None:
            return list(queue())  # type: ignore[operator]
        waiting = waiting_sessions()
        return [SessionKey(e.tenant, e.session_id) for e in waiting if e.session_id is not None]

    def tell(self, what: str, key: Hashable, *args: Any) -> None:
        """touch / forget / set_priority of a session (a custom chooser may lack the last)."""
        hook = getattr(self.chooser, what, None)
        if hook is None or self.tiers is None:
            return
        with self.tiers.lock:
            hook(key, *args)

    def prefetch_candidates(self) -> list[Hashable]:
        candidates = getattr(self.chooser, "prefetch_candidates", None)
        tiers = self.tiers
        if candidates is None or tiers is None or tiers.top is None:
            return []
        with tiers.lock:
            result: list[Hashable] = candidates(self.session_tier, top=tiers.top.name)
            return result

    def session_tier(self, key: Hashable) -> str | None:
        """The slowest tier any of the session's chunks is in (None: none stored)."""
        chain = self.index.get(key)  # type: ignore[arg-type]
        if chain is None or self.tiers is None:
            return None
        names = [t.name for t in self.tiers.tiers]
        worst = None
        for chunk in chain.chunks:
            where = self.tiers.where(chunk)
            if where is None:
                return worst
            if worst is None or names.index(where) > names.index(worst):
                worst = where
        return worst

    def mean_session_bytes(self) -> float:
        n = len(self.index)
        if not n or self.tiers is None:
            return 0.0
        return sum(t.used_bytes() for t in self.tiers.tiers) / n
