"""Eviction's order kept as it changes, so that one victim costs O(log n), not O(owners).

A chunk is worth what its most valuable owner is worth (chunk_placement.py). Ranking every owner
of every chunk at each eviction cost O(S log S) once S sessions share a chunk (a system prompt
held by all of them). Here each rank is kept as it changes instead:

    session rank  (the chooser's rank_key without the queue, tiebreak): recomputed when the
                  chooser says the session changed (touch, forget, set_priority). The tiebreak
                  keeps two sessions from tying (only never-touched ones could): the one seen
                  first ranks higher, so a restore adding sessions leaves a shared chunk's best
                  owner where it is
    chunk rank    its best owner's: a heap of its owners' ranks, best on top; an entry whose
                  session let go of the chunk or was re-ranked is dropped when it comes up
    tier order    a heap per evicting tier of (0, seq) for a chunk nobody holds, else
                  (1, chunk rank, -position, seq); seq is the order the tier took the chunk in.
                  So orphans first (in the tier's order), then the lowest chunk rank, the deepest
                  chunk of one session first: the order of the walk over ranked owners it replaces

The queue (aware): a queued session may rank higher than without it, never lower (the policy is
`queue_local`). A decision asks the chooser for the sessions the queue raises, lifts their chunks
to the raised rank, and walks its tier's heap from the bottom: lifted chunks are set aside with
their lifted rank, and the first chunk not lifted ends the walk (nothing after it ranks lower).

Changes arrive on other threads (the index's under the store's lock, LMDB's under the I/O lock or
on a reader, a chooser's under the tiers' lock) and are queued, never applied there: they are
applied under the tiers' lock at the next decision, or by whoever queues past `_APPLY_AT` when
that lock is free (a restore of many sessions then holds it only briefly at a time).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable, Collection, Container, Hashable
from typing import Any, Protocol

from chatstore.store.placement.policies.chooser import RankKey
from chatstore.store.session_kv import ChunkKey, SessionKey
from chatstore.store.sessions.index import SessionIndex
from chatstore.store.tiers.base import StorageTier

log = logging.getLogger(__name__)

_APPLY_AT = 4096  # queued changes past which a producer applies them (lock free)
OrderKey = tuple[Any, ...]


class RankingChooser(Protocol):
    """What ChunkRanks asks of a session chooser (policies/chooser.py's PolicyChooser)."""

    def watch(self, watcher: Callable[[Hashable], None]) -> None: ...
    def rank_key(self, key: Hashable) -> RankKey: ...
    def queued_rank_keys(self) -> dict[Any, RankKey]: ...  # keyed by SessionKey here


class _Rank:
    """One session's rank as it stands; a new object at each change, so an entry in an owner
    heap is current exactly when it is the session's object (an identity test)."""

    __slots__ = ("rank", "session", "tie")

    def __init__(self, rank: RankKey, tie: int, session: SessionKey) -> None:
        self.rank, self.tie, self.session = rank, tie, session

    def __lt__(self, other: _Rank) -> bool:  # heapq keeps the smallest on top: the best here
        if self.rank != other.rank:
            return bool(self.rank > other.rank)
        return self.tie > other.tie


class ChunkRanks:
    def __init__(self, chooser: RankingChooser, index: SessionIndex, lock: threading.RLock):
        self._chooser, self._index, self._lock = chooser, index, lock
        self._pending: deque[tuple[Any, ...]] = deque()
        self._ranks: dict[SessionKey, _Rank] = {}
        self._owners: dict[ChunkKey, list[_Rank]] = {}  # heaps, best owner on top
        self._members: dict[str, dict[ChunkKey, int]] = {}  # tier -> chunk -> seq
        self._current: dict[str, dict[ChunkKey, OrderKey]] = {}  # tier -> chunk -> its key
        self._heaps: dict[str, list[tuple[OrderKey, int, ChunkKey]]] = {}
        self._seq = itertools.count()
        self._pushes = itertools.count()  # in heap entries: equal keys never compare chunks
        self._tiebreak = itertools.count(0, -1)  # seen first ranks higher among equals
        self._shared: dict[RankKey, RankKey] = {}  # rank -> the one object for it (_rank_key)
        chooser.watch(lambda session: self._queue(("s", session)))
        index.watch(lambda session, taken, let_go: self._queue(("o", session, taken, let_go)))
        with lock:
            for session in index.sessions():
                self._queue(("s", session))

    def track(self, tier: StorageTier) -> bool:
        """Keep tier's eviction order; False for a tier that cannot tell its changes."""
        name = tier.name
        with self._lock:  # ready before the first change can be applied
            self._members[name], self._current[name], self._heaps[name] = {}, {}, []
            if not tier.watch(lambda chunk, held: self._queue(("m", name, chunk, held))):
                del self._members[name], self._current[name], self._heaps[name]
                return False
            for chunk in tier.keys():  # noqa: SIM118 (a tier, not a dict)
                self._queue(("m", name, chunk, True))
        return True

    def tracks(self, tier: str) -> bool:
        return tier in self._heaps

    # -- changes ------------------------------------------------------------------------------

    def _queue(self, change: tuple[Any, ...]) -> None:
        self._pending.append(change)
        if len(self._pending) > _APPLY_AT and self._lock.acquire(blocking=False):
            try:
                self.apply()
            except Exception:  # the producer is the index or a tier mid-change: not its fault
                log.exception("applying eviction rank changes failed")
            finally:
                self._lock.release()

    def apply(self) -> None:
        """Every queued change (under the tiers' lock)."""
        pending = self._pending
        while pending:
            change = pending.popleft()
            if change[0] == "o":
                self._owners_changed(change[1], change[2], change[3])
            elif change[0] == "m":
                self._member_changed(change[1], change[2], change[3])
            else:
                self._session_changed(change[1])

    def _session_changed(self, session: SessionKey) -> None:
        chain = self._index.get(session)
        if chain is None:
            self._ranks.pop(session, None)  # holds nothing: its entries go stale
            return
        old = self._ranks.get(session)
        ranked = self._rank_key(session)
        if old is not None and old.rank == ranked:
            return
        tie = old.tie if old is not None else next(self._tiebreak)
        rank = self._ranks[session] = _Rank(ranked, tie, session)
        for chunk in chain.chunks:
            if self._index.holds(chunk, session) and self._push(chunk, rank):
                self._reorder(chunk)

    def _owners_changed(
        self, session: SessionKey, taken: list[ChunkKey], let_go: list[ChunkKey]
    ) -> None:
        rank = self._ranks.get(session)
        if taken and rank is None:
            rank = _Rank(self._rank_key(session), next(self._tiebreak), session)
            self._ranks[session] = rank
        for chunk in taken:
            if rank is not None and self._push(chunk, rank):  # (or a sole holder moved it)
                self._reorder(chunk)
        if let_go and self._index.get(session) is None:
            self._ranks.pop(session, None)
        for chunk in let_go:
            if not self._index.referenced(chunk):
                self._owners.pop(chunk, None)  # nobody's: an orphan now, or gone
            self._reorder(chunk)

    def _member_changed(self, tier: str, chunk: ChunkKey, held: bool) -> None:
        members = self._members[tier]
        if not held:
            members.pop(chunk, None)
            self._current[tier].pop(chunk, None)  # its heap entries go stale
        elif chunk not in members:  # a tier re-writing a chunk keeps its place in the order
            members[chunk] = next(self._seq)
            self._place(tier, chunk, self._best(chunk))

    # -- ranks --------------------------------------------------------------------------------

    def _rank_key(self, session: SessionKey) -> RankKey:
        """The chooser's rank, one object for equal ranks (every never-touched session of a
        priority has the same: a restore of many sessions keeps one)."""
        ranked = self._chooser.rank_key(session)
        shared = self._shared
        if len(shared) > 64:  # touched sessions' ranks are all different: keep a few only
            shared.clear()
        return shared.setdefault(ranked, ranked)

    def _push(self, chunk: ChunkKey, rank: _Rank) -> bool:
        """rank into chunk's owner heap; whether the chunk's best owner may have changed. Every
        change that can spoil a heap's top (an owner letting go, re-ranked) re-reads it, so a
        rank that lands below a top of another session leaves the best where it was."""
        heap = self._owners.get(chunk)
        if heap is None:
            self._owners[chunk] = [rank]
            return True
        heapq.heappush(heap, rank)
        if len(heap) > 16 and len(heap) > 2 * self._index.owner_count(chunk) + 16:
            live = (self._ranks.get(s) for s in self._index.owners_of(chunk))
            heap[:] = [r for r in live if r is not None]  # mostly stale: rebuilt, O(1) a push
            heapq.heapify(heap)
            return True
        return heap[0] is rank or heap[0].session == rank.session

    def _best(self, chunk: ChunkKey) -> _Rank | None:
        """The chunk's best current owner (None: nobody holds it), stale tops dropped."""
        heap = self._owners.get(chunk)
        if heap is None:
            return None
        while heap:
            top = heap[0]
            if self._ranks.get(top.session) is top and self._index.holds(chunk, top.session):
                return top
            heapq.heappop(heap)
        del self._owners[chunk]
        return None

    def _reorder(self, chunk: ChunkKey) -> None:
        """The chunk's owners changed: its place in each tier holding it follows (a chunk in
        no tier is placed when a tier takes it)."""
        tiers = [tier for tier, members in self._members.items() if chunk in members]
        if tiers:
            best = self._best(chunk)
            for tier in tiers:
                self._place(tier, chunk, best)

    def _order_key(self, tier: str, chunk: ChunkKey, best: _Rank | None) -> OrderKey:
        seq = self._members[tier][chunk]
        if best is None:
            return (0, seq)
        return (1, best.rank, best.tie, -self._index.position_of(chunk), seq)

    def _place(self, tier: str, chunk: ChunkKey, best: _Rank | None) -> None:
        key = self._order_key(tier, chunk, best)
        current = self._current[tier]
        if current.get(chunk) == key:
            return
        current[chunk] = key
        heap = self._heaps[tier]
        heapq.heappush(heap, (key, next(self._pushes), chunk))
        if len(heap) > 2 * len(current) + 64:  # mostly stale: rebuild
            heap[:] = [(k, next(self._pushes), c) for c, k in current.items()]
            heapq.heapify(heap)

    def _lifted(self) -> dict[ChunkKey, tuple[RankKey, int]]:
        """Chunks the queue raises, with the rank it raises them to: the best raised owner's."""
        lifted: dict[ChunkKey, tuple[RankKey, int]] = {}  # chunk -> (rank, tie)
        for session, ranked in self._chooser.queued_rank_keys().items():
            rank = self._ranks.get(session)
            chain = self._index.get(session)
            if rank is None or chain is None:
                continue  # holds nothing
            key = (ranked, rank.tie)
            for chunk in chain.chunks:
                if chunk not in lifted or lifted[chunk] < key:
                    lifted[chunk] = key
        return lifted

    # -- decisions ----------------------------------------------------------------------------

    def victim(
        self, tier: str, exclude: Collection[ChunkKey], pinned: Container[ChunkKey] | None
    ) -> ChunkKey | None:
        """The chunk tier gives up first, never one in `exclude` or `pinned` (under the tiers'
        lock); None when there is none."""
        self.apply()
        heap, current = self._heaps[tier], self._current[tier]
        lifted = self._lifted()
        aside: list[tuple[OrderKey, int, ChunkKey]] = []
        best_lifted: tuple[OrderKey, ChunkKey] | None = None
        victim = None
        while heap:
            entry = heapq.heappop(heap)
            key, _, chunk = entry
            if current.get(chunk) != key:
                continue  # stale: the chunk moved in the order or left the tier
            aside.append(entry)
            if chunk in exclude or (pinned is not None and chunk in pinned):
                continue
            lift = lifted.get(chunk)
            if lift is not None and key[0] == 1 and lift > key[1:3]:
                raised = (1, *lift, *key[3:])
                if best_lifted is None or raised < best_lifted[0]:
                    best_lifted = (raised, chunk)
                continue
            victim = chunk if best_lifted is None or key < best_lifted[0] else best_lifted[1]
            break
        else:
            victim = best_lifted[1] if best_lifted is not None else None
        for entry in aside:
            heapq.heappush(heap, entry)
        return victim
