"""Which session a full tier gives up: the hook through which an eviction policy plugs in.

The hierarchy tells the chooser about every access and removal and asks it for a victim among a
tier's sessions. The default is least-recently-used; `placement.policies` provides the
scheduler-aware and FIFO choosers behind the same three methods.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from chatstore.store.session_kv import ChunkKey


class VictimChooser(Protocol):
    def touch(self, key: ChunkKey) -> None:
        """key was stored or used."""
        ...

    def forget(self, key: ChunkKey) -> None:
        """key left the store."""
        ...

    def choose_victim(self, tier: str, candidates: list[ChunkKey]) -> ChunkKey | None:
        """One of candidates to move out of tier, or None to refuse."""
        ...


class LruChooser:
    """Least recently used first; keys never touched (found on disk at start) count as oldest.
    A key's priority (set_priority; retention.py) comes before recency: lower goes first."""

    def __init__(self) -> None:
        self._order: OrderedDict[ChunkKey, None] = OrderedDict()
        self._priority: dict[ChunkKey, int] = {}

    def set_priority(self, key: ChunkKey, priority: int) -> None:
        if priority:
            self._priority[key] = priority
        else:
            self._priority.pop(key, None)

    def touch(self, key: ChunkKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def forget(self, key: ChunkKey) -> None:
        self._order.pop(key, None)

    def choose_victim(self, tier: str, candidates: list[ChunkKey]) -> ChunkKey | None:
        if not candidates:
            return None
        if self._priority:
            return self.rank(tier, candidates)[0]
        pending = set(candidates)
        for key in candidates:
            if key not in self._order:
                return key
        for key in self._order:
            if key in pending:
                return key
        return candidates[0]

    def rank(self, tier: str, candidates: list[ChunkKey]) -> list[ChunkKey]:
        """candidates, least recently used first (never touched ones lead)."""
        pending = set(candidates)
        unseen = [key for key in candidates if key not in self._order]
        ranked = unseen + [key for key in self._order if key in pending]
        if self._priority:  # stable: recency order inside one priority
            ranked.sort(key=lambda key: self._priority.get(key, 0))
        return ranked
