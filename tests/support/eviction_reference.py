"""The chunk eviction walk as it was before the placement kept ranks (issue 37 item 4), kept as
the reference that placement/chunk_ranks.py is checked against.

Straightforward and O(S log S) a victim once S sessions share a chunk: every candidate's owner
set copied, every owner of every candidate ranked by the session chooser, and the ranking walked
until some candidate has had all its owners passed (the deepest such chunk of that session).
Chunks nobody holds go first, in the tier's order; pinned chunks are never a victim.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Hashable, Iterable

from chatstore.store.session_kv import ChunkKey


def reference_victim(
    candidates: list[ChunkKey],
    owners: Callable[[ChunkKey], Iterable[Hashable]],
    rank: Callable[[list[Hashable]], list[Hashable]],
    position: Callable[[ChunkKey], int],
    pinned: Container[ChunkKey] = frozenset(),
) -> ChunkKey | None:
    """The victim among candidates (in the tier's order); rank: sessions, first to go first."""
    candidates = [c for c in candidates if c not in pinned]
    if not candidates:
        return None
    holders = {c: frozenset(owners(c)) for c in candidates}
    orphans = [c for c in candidates if not holders[c]]
    if orphans:
        return orphans[0]
    by_session: dict[Hashable, list[ChunkKey]] = {}
    for chunk, theirs in holders.items():
        for session in theirs:
            by_session.setdefault(session, []).append(chunk)
    passed: set[Hashable] = set()
    for session in rank(list(by_session)):
        passed.add(session)
        mine = [c for c in by_session[session] if holders[c] <= passed]
        if mine:
            return max(mine, key=position)
    return candidates[-1]
