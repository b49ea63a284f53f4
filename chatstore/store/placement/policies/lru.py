"""LRU baseline: evict the session whose last turn is oldest. Blind to the queue; no prefetch."""

from __future__ import annotations

from collections.abc import Generator, Hashable, Sequence

from chatstore.store.placement.policies.base import EvictionPolicy
from chatstore.store.placement.policies.lookahead import Lookahead
from chatstore.store.placement.policies.order import StampOrder


class LRUPolicy(EvictionPolicy):
    """Least recently used first. A demoted or promoted session keeps its last-use stamp."""

    name = "lru"
    queue_local = True  # blind to the queue; a value changes on on_access / on_forget only

    def __init__(self, capacities: Sequence[int] = ()) -> None:
        super().__init__(capacities)
        self._last_use: dict[Hashable, int] = {}
        self._order: dict[int, StampOrder] = {}

    def on_access(self, session: Hashable) -> None:
        self._last_use[session] = next(self._clock)
        tier = self._tier.get(session)
        if tier is not None:
            self._order[tier].add(session, self._last_use[session])

    def on_forget(self, session: Hashable) -> None:
        self._last_use.pop(session, None)

    def _stamp(self, session: Hashable) -> int:
        stamp = self._last_use.get(session)
        if stamp is None:
            stamp = self._last_use[session] = next(self._clock)
        return stamp

    def _inserted(self, tier: int, session: Hashable) -> None:
        self._order.setdefault(tier, StampOrder()).add(session, self._stamp(session))

    def _removed(self, tier: int, session: Hashable) -> None:
        self._order[tier].discard(session)

    def order_value(self, session: Hashable, lookahead: Lookahead) -> float | tuple[int, float]:
        return self._last_use.get(session, float("inf"))

    def _ranked(self, tier: int, lookahead: Lookahead) -> Generator[Hashable, None, None]:
        order = self._order.get(tier)
        if order is not None:
            yield from order.oldest_first()
