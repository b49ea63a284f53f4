"""A placement policy behind `TierHierarchy`'s `VictimChooser` protocol.

The hierarchy asks for one victim at a time among a tier's sessions and reports uses
(`touch`) and departures (`forget`), but not sizes or tiers. So the adapter ranks the candidates
it is handed by the policy's `value`, with the look-ahead rebuilt from the scheduler's waiting
queue at each call, and S_kv (which sizes the windows) asked of the hierarchy:

    policy = make_policy(config.policy, capacities=[t.capacity for t in tiers])
    chooser = PolicyChooser(policy, queue=scheduler.waiting_sessions, mean_kv_bytes=mean_kv)
    hierarchy = TierHierarchy(tiers, chooser=chooser)
    ...
    for key in chooser.prefetch_candidates(hierarchy.tier_of, top=tiers[0].name):
        hierarchy.prefetch(key)                  # scheduler-aware fetch, e.g. once per step

Sessions the adapter has never seen touched (found on disk at start-up) go first, as in
`LruChooser`, but only inside their priority: every ranking is by (priority, touched, value).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from chatstore.store.placement.policies.base import EvictionPolicy
from chatstore.store.placement.policies.lookahead import Lookahead, QueueLookahead


class PolicyChooser:
    """`touch` / `forget` / `choose_victim` (+ `prefetch_candidates`) over an EvictionPolicy."""

    def __init__(
        self,
        policy: EvictionPolicy,
        queue: Callable[[], Iterable[Hashable]] = tuple,
        mean_kv_bytes: Callable[[], float] | None = None,
    ) -> None:
        self.policy = policy
        self._queue = queue
        self._seen: set[Hashable] = set()
        self._mean_kv_bytes = mean_kv_bytes
        if mean_kv_bytes is not None:
            policy.kv_bytes_source = mean_kv_bytes

    @contextmanager
    def _pinned(self) -> Iterator[None]:
        """S_kv asked once per decision, not once per session ranked (it may cost O(sessions))."""
        source = self._mean_kv_bytes
        if source is None:
            yield
            return
        s_kv = source()
        self.policy.kv_bytes_source = lambda: s_kv
        try:
            yield
        finally:
            self.policy.kv_bytes_source = source

    def touch(self, key: Hashable) -> None:
        self._seen.add(key)
        self.policy.on_access(key)

    def forget(self, key: Hashable) -> None:
        self._seen.discard(key)
        self.policy.on_forget(key)

    def set_priority(self, key: Hashable, priority: int) -> None:
        self.policy.set_priority(key, priority)

    def _rank_key(self, key: Hashable, lk: Lookahead) -> tuple[int, bool, Any]:
        """Lower goes first: priority, then never-touched keys, then the policy's value."""
        seen = key in self._seen
        return self.policy.priority(key), seen, self.policy.value(key, lk) if seen else ()

    def choose_victim(self, tier: str, candidates: list[Hashable]) -> Hashable | None:
        if not candidates:
            return None
        lk = QueueLookahead(self._queue())
        with self._pinned():
            return min(candidates, key=lambda key: self._rank_key(key, lk))

    def rank(self, tier: str, candidates: list[Hashable]) -> list[Hashable]:
        """candidates, lowest (first to go) first."""
        lk = QueueLookahead(self._queue())
        with self._pinned():
            return sorted(candidates, key=lambda key: self._rank_key(key, lk))

    def ranked_below(self, key: Hashable, candidates: list[Hashable]) -> list[Hashable]:
        """The candidates `key` outranks (what a prefetch of `key` may push out). A key never
        touched (found on disk at start-up) outranks nothing unless its next turn is queued."""
        lk = QueueLookahead(self._queue())
        if key not in self._seen and lk.position(key) is None:
            return []
        with self._pinned():
            mine = (self.policy.priority(key), True, self.policy.value(key, lk))
            return [c for c in candidates if self._rank_key(c, lk) < mine]

    def prefetch_candidates(
        self, tier_of: Callable[[Hashable], str | None], top: str
    ) -> list[Hashable]:
        """Queued sessions inside the prefetch window that sit below tier `top`, soonest first."""
        with self._pinned():
            head = QueueLookahead(self._queue()).head(self.policy.prefetch_window())
        return [key for key in head if tier_of(key) not in (None, top)]
