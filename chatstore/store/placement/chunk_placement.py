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
"""

from __future__ import annotations

from collections.abc import Callable, Container, Hashable
from typing import Any

from chatstore.store.chunks import ChunkKey


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

    def touch(self, key: Hashable) -> None:
        return None

    def forget(self, key: Hashable) -> None:
        return None

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
