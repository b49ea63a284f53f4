"""A set of sessions kept sorted by a stamp (last use, first insert): oldest first, O(log n) find.

A sorted list with `bisect` rather than an OrderedDict, because sessions enter a tier out of stamp
order (a demoted or prefetched session keeps its old stamp). Inserts and deletes move memory in C,
which is cheap for the tens of thousands of sessions a store holds.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Iterator


class StampOrder:
    """Sessions ordered by a unique integer stamp."""

    def __init__(self) -> None:
        self._stamps: list[int] = []  # sorted
        self._sessions: list[Hashable] = []  # parallel to _stamps
        self._stamp_of: dict[Hashable, int] = {}

    def add(self, session: Hashable, stamp: int) -> None:
        self.discard(session)
        i = bisect.bisect_left(self._stamps, stamp)
        self._stamps.insert(i, stamp)
        self._sessions.insert(i, session)
        self._stamp_of[session] = stamp

    def discard(self, session: Hashable) -> None:
        stamp = self._stamp_of.pop(session, None)
        if stamp is None:
            return
        i = bisect.bisect_left(self._stamps, stamp)
        del self._stamps[i]
        del self._sessions[i]

    def oldest_first(self) -> Iterator[Hashable]:
        """Iterate oldest first; do not mutate the order while iterating."""
        return iter(self._sessions)

    def __contains__(self, session: Hashable) -> bool:
        return session in self._stamp_of

    def __len__(self) -> int:
        return len(self._stamps)
