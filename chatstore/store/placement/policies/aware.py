"""Scheduler-aware eviction and prefetch (CachedAttention §3.3), driven by the waiting queue.

With S_kv the mean KV size of a resident session and C_t the capacity of tier t:

    eviction window  L_ev = (C_0 + C_1 + ...) / S_kv   first L_ev distinct queued sessions
    prefetch window  L_pw = C_0 / S_kv                 first L_pw distinct queued sessions

    queue:   s4 s2 s9 s7 s1 s5 | s8 s6 ...      (| = end of the eviction window)
    victims: residents outside the window, least recently used first; then, once none is left,
             residents inside it from the tail towards the head: s5, s1, s7, ...

So a session in the window is never evicted while a resident outside it exists (the property
`tests/store/placement/test_policy.py` checks). The same order serves every tier: DRAM demotes
to SSD what the queue needs last, SSD drops it. Prefetch brings the sessions in L_pw that sit
below DRAM up to it; the tier manager asks `choose_victims(0, ..., incoming=s)` for room, so a
prefetch only displaces sessions that are needed later than `s` (or not at all).

The paper sizes L_pw from the DRAM *available* for prefetch; here it is the whole DRAM tier, since
DRAM holds exactly what the order above ranks highest.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Hashable, Sequence

from chatstore.store.placement.policies.lookahead import Lookahead
from chatstore.store.placement.policies.lru import LRUPolicy


class AwarePolicy(LRUPolicy):
    """Look-ahead window first, LRU outside it."""

    name = "aware"
    # Unqueued: LRU's value. Queued inside the window: (1, -pos), above every (0, last use) of
    # the same priority; so the queue only raises the sessions it holds.
    queue_local = True

    def __init__(self, capacities: Sequence[int] = ()) -> None:
        if not capacities:
            raise ValueError(f"policy {self.name!r} needs the tier capacities to size its windows")
        super().__init__(capacities)

    def windows(self) -> tuple[int, int]:
        """(L_pw, L_ev) in distinct sessions; (0, 0) while nothing is resident."""
        s_kv = self.mean_kv_bytes()
        if s_kv <= 0:
            return 0, 0
        return int(self.capacities[0] / s_kv), int(sum(self.capacities) / s_kv)

    def prefetch_window(self) -> int:
        return self.windows()[0]

    def prefetch_candidates(self, lookahead: Lookahead) -> list[Hashable]:
        return [s for s in lookahead.head(self.prefetch_window()) if self._tier.get(s, 0) > 0]

    def order_value(self, session: Hashable, lookahead: Lookahead) -> float | tuple[int, float]:
        pos = lookahead.position(session)
        if pos is not None and pos < lookahead.window_end(self.windows()[1]):
            return 1, -pos
        return 0, self._last_use.get(session, math.inf)

    def _ranked(self, tier: int, lookahead: Lookahead) -> Generator[Hashable, None, None]:
        order = self._order.get(tier)
        if order is None:
            return
        end = lookahead.window_end(self.windows()[1])
        inside: list[tuple[float, Hashable]] = []
        for s in order.oldest_first():
            pos = lookahead.position(s)
            if pos is None or pos >= end:
                yield s
            else:
                inside.append((pos, s))
        inside.sort(key=lambda e: e[0], reverse=True)
        for _, s in inside:
            yield s
