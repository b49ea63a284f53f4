"""Eviction over chunks, decided per session (the paper's unit): `ChunkPlacement`.

The tiers hold chunks and ask for one victim chunk at a time. A chunk belongs to every session
whose chain lists it (a shared system prompt: many), so it is worth what its most valuable
owner is worth. The adapter ranks the owners of the candidates with the session policy (aware,
LRU, FIFO: lowest value first) and walks that ranking: the victim is a chunk all of whose owners
have been passed, latest in its chain first (a session loses its newest chunks before the
prefix others may share). Chunks no session owns (left over, about to be freed) go first.

The session policy is told about sessions by the store (`touch` on a turn, `forget` on delete);
the tiers' own `touch` / `forget` of chunks carry no session information and are ignored.

Pinned chunks (sessions/holds.py: held by a turn opened and not yet read by the engine) are never a
victim in the DRAM tier, whatever their sessions rank: with only pinned chunks left there is no
victim, and what wanted the room goes elsewhere.

The tiers ask through `victim(tier, exclude)`. Once the placement knows the tiers (`bind_tiers`,
from ChunkTiers) and the index (`follow`, from SessionPlacement), and the session chooser keeps
its ranks incrementally (aware, LRU, FIFO), the answer comes from ranks kept as they change
(chunk_ranks.py): O(log n) a victim, whatever the number of sessions holding a chunk. Otherwise
(another chooser, a tier that cannot tell its changes) `choose_victim` walks the ranked owners of
every chunk in the tier, as it always did; both give the same victim.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Container, Hashable
from typing import Any

from chatstore.store.placement.chunk_ranks import ChunkRanks
from chatstore.store.session_kv import ChunkKey
from chatstore.store.sessions.index import SessionIndex
from chatstore.store.tiers.base import StorageTier


class ChunkPlacement:
    def __init__(
        self,
        sessions: Any,
        owners: Callable[[ChunkKey], frozenset[Hashable]],
        position: Callable[[ChunkKey], int],
        pinned: Container[ChunkKey] = frozenset(),
        pinned_in: str | None = None,
    ) -> None:
        self.sessions = sessions  # a VictimChooser over session keys
        self._owners = owners
        self._position = position
        self._pinned = pinned  # chunks no eviction from tier `pinned_in` may pick
        self._pinned_in = pinned_in
        self._tiers: list[StorageTier] = []
        self._lock: threading.RLock | None = None
        self._index: SessionIndex | None = None
        self.ranks: ChunkRanks | None = None  # kept ranks, once tiers and index are known

    def bind_tiers(self, tiers: list[StorageTier], lock: threading.RLock) -> None:
        """The tiers this placement evicts from, and the lock their decisions run under."""
        self._tiers, self._lock = tiers, lock
        self._start_ranks()

    def follow(self, index: SessionIndex) -> None:
        """The index whose owners `owners` / `position` read: its changes are followed."""
        self._index = index
        self._start_ranks()

    def _start_ranks(self) -> None:
        index, lock = self._index, self._lock
        if self.ranks is not None or index is None or lock is None:
            return
        if not getattr(self.sessions, "ranks_incrementally", False):
            return  # a chooser whose ranks move untold: the walk below, each time
        self.ranks = ChunkRanks(self.sessions, index, lock)
        for tier in self._tiers:
            if not tier.remote:  # the shared tier is Redis's to evict: never asked
                self.ranks.track(tier)

    def touch(self, key: Hashable) -> None:
        return None

    def forget(self, key: Hashable) -> None:
        return None

    def victim(self, tier: StorageTier, exclude: Collection[ChunkKey]) -> ChunkKey | None:
        """The chunk `tier` gives up first, never one in `exclude` (under the tiers' lock)."""
        ranks = self.ranks
        if ranks is not None and ranks.tracks(tier.name):
            pinned = self._pinned if tier.name == self._pinned_in else None
            return ranks.victim(tier.name, exclude, pinned)
        candidates = [k for k in tier.keys() if k not in exclude]  # noqa: SIM118
        return self.choose_victim(tier.name, candidates)

    def choose_victim(self, tier: str, candidates: list[ChunkKey]) -> ChunkKey | None:
        if tier == self._pinned_in:
            candidates = [c for c in candidates if c not in self._pinned]
        if not candidates:
            return None
        owners = {c: self._owners(c) for c in candidates}
        orphans = [c for c in candidates if not owners[c]]
        if orphans:
            return orphans[0]
        by_session: dict[Hashable, list[ChunkKey]] = {}
        for chunk, holders in owners.items():
            for session in holders:
                by_session.setdefault(session, []).append(chunk)
        passed: set[Hashable] = set()
        for session in self._ranked(tier, list(by_session)):
            passed.add(session)
            mine = [c for c in by_session[session] if owners[c] <= passed]
            if mine:
                return max(mine, key=self._position)
        return candidates[-1]

    def may_displace(self, incoming: ChunkKey, victim: ChunkKey) -> bool:
        """Whether a prefetch of `incoming` may push `victim` out: only if some owner of the
        incoming chunk outranks every owner of the victim (a session policy without
        `ranked_below` allows it)."""
        ranked_below = getattr(self.sessions, "ranked_below", None)
        theirs = self._owners(victim)
        if ranked_below is None or not theirs:
            return True
        candidates = list(theirs)
        return any(set(ranked_below(s, candidates)) >= theirs for s in self._owners(incoming))

    def _ranked(self, tier: str, sessions: list[Hashable]) -> list[Hashable]:
        rank = getattr(self.sessions, "rank", None)
        if rank is not None:
            return rank(tier, sessions)
        left, order = list(sessions), []
        while left:
            victim = self.sessions.choose_victim(tier, left)
            if victim is None:
                break
            order.append(victim)
            left.remove(victim)
        return order + left
