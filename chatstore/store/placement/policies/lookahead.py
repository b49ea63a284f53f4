"""The scheduler's waiting queue as the store's policies see it: who runs next, in order.

A look-ahead orders the *distinct* sessions that have a job waiting. Each has a position, a sort
key (smaller = runs sooner); a window of length L holds the first L distinct sessions:

    queue (jobs):   s3  s1  s3  s7  s2  s9 ...
    distinct:       s3  s1  s7  s2  s9 ...
    window(3):     [s3  s1  s7] s2  s9        position(s) < window_end(3)  <=>  s in window(3)

Positions may be ranks 0, 1, 2, ... (`QueueLookahead`, built from a list each time) or any
increasing ticket, e.g. the job's arrival number (`SortedLookahead`, kept up to date in place,
which is what a scheduler with a long queue or a trace replay wants). Policies only compare them.
"""

from __future__ import annotations

import bisect
import math
from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterable, Iterator


class Lookahead(ABC):
    """An ordered view of the sessions that will run next."""

    @abstractmethod
    def position(self, session: Hashable) -> float | None:
        """Sort key of the session's next job (smaller = sooner); None if it has none queued."""

    @abstractmethod
    def window_end(self, length: int) -> float:
        """Positions strictly below this lie inside a window of `length` distinct sessions."""

    @abstractmethod
    def head(self, length: int) -> list[Hashable]:
        """The first `length` distinct sessions, soonest first."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of distinct sessions queued."""

    def in_window(self, session: Hashable, length: int) -> bool:
        pos = self.position(session)
        return pos is not None and pos < self.window_end(length)


class QueueLookahead(Lookahead):
    """Look-ahead built from the scheduler's queue as a list of session ids (repeats allowed)."""

    def __init__(self, sessions: Iterable[Hashable] = ()) -> None:
        self._rank: dict[Hashable, int] = {}
        for s in sessions:
            self._rank.setdefault(s, len(self._rank))
        self._order = list(self._rank)

    def position(self, session: Hashable) -> float | None:
        return self._rank.get(session)

    def window_end(self, length: int) -> float:
        return float(length) if length < len(self._order) else math.inf

    def head(self, length: int) -> list[Hashable]:
        return self._order[: max(length, 0)]

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._order)


class SortedLookahead(Lookahead):
    """Look-ahead kept up to date in place: `push` when a job is queued, `pop` when it runs.

    Each session holds at most one position (its soonest job); keys must be unique, e.g. a job's
    arrival ticket or, in a trace replay, the index of its turn in the trace.
    """

    def __init__(self) -> None:
        self._keys: list[float] = []  # sorted positions
        self._sessions: list[Hashable] = []  # parallel to _keys
        self._pos: dict[Hashable, float] = {}

    def push(self, session: Hashable, key: float) -> None:
        """Queue `session` at `key`; a session already queued keeps the sooner of the two."""
        old = self._pos.get(session)
        if old is not None:
            if old <= key:
                return
            self.pop(session)
        i = bisect.bisect_left(self._keys, key)
        self._keys.insert(i, key)
        self._sessions.insert(i, session)
        self._pos[session] = key

    def pop(self, session: Hashable) -> None:
        """Remove the session from the queue (its job is running)."""
        key = self._pos.pop(session)
        i = bisect.bisect_left(self._keys, key)
        while self._sessions[i] != session:  # equal keys: find ours
            i += 1
        del self._keys[i]
        del self._sessions[i]

    def position(self, session: Hashable) -> float | None:
        return self._pos.get(session)

    def window_end(self, length: int) -> float:
        return self._keys[length] if length < len(self._keys) else math.inf

    def head(self, length: int) -> list[Hashable]:
        return self._sessions[: max(length, 0)]

    def __len__(self) -> int:
        return len(self._keys)
