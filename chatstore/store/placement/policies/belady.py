"""Belady's MIN, the reference bound for the simulator: evict the session used furthest ahead.

It needs the whole future (a trace replay has it; a server does not), bound once with `bind`;
the look-ahead passed to `choose_victims` is ignored. So it is not a store option. Sessions that
never run again go first. A resident session's next use cannot change until it runs, and a run
takes it out of its tier first, so each tier is a heap keyed at insertion (lazy deletion).
Prefetch as `aware`, over the same bound future.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Generator, Hashable, Sequence

from chatstore.store.placement.policies.aware import AwarePolicy
from chatstore.store.placement.policies.lookahead import Lookahead


class BeladyPolicy(AwarePolicy):
    """Furthest next use first, by the future given to `bind`."""

    name = "belady"
    queue_local = False  # every value moves with the bound future, untold

    def __init__(self, capacities: Sequence[int] = ()) -> None:
        super().__init__(capacities)
        self._future: Lookahead | None = None
        self._heap: dict[int, list[tuple[float, int, Hashable]]] = {}
        self._entry: dict[Hashable, int] = {}  # session -> id of its live heap entry

    def bind(self, future: Lookahead) -> None:
        """The complete future: every session's next run, kept up to date by the caller."""
        self._future = future

    def prefetch_candidates(self, lookahead: Lookahead) -> list[Hashable]:
        return super().prefetch_candidates(self._bound())

    def _bound(self) -> Lookahead:
        if self._future is None:
            raise RuntimeError("belady needs the whole future: call bind(lookahead) first")
        return self._future

    def _key(self, session: Hashable) -> float:
        pos = self._bound().position(session)
        return -math.inf if pos is None else -pos

    def order_value(self, session: Hashable, lookahead: Lookahead) -> float:
        return self._key(session)

    def _inserted(self, tier: int, session: Hashable) -> None:
        super()._inserted(tier, session)
        entry = next(self._clock)
        self._entry[session] = entry
        heapq.heappush(self._heap.setdefault(tier, []), (self._key(session), entry, session))

    def _removed(self, tier: int, session: Hashable) -> None:
        super()._removed(tier, session)
        del self._entry[session]

    def _ranked(self, tier: int, lookahead: Lookahead) -> Generator[Hashable, None, None]:
        heap = self._heap.get(tier, [])
        taken: list[tuple[float, int, Hashable]] = []
        try:
            while heap:
                item = heapq.heappop(heap)
                if self._entry.get(item[2]) != item[1]:
                    continue  # stale: the session moved or left
                taken.append(item)
                yield item[2]
        finally:
            for item in taken:
                heapq.heappush(heap, item)
