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
`LruChooser`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable

from chatstore.store.policy.base import EvictionPolicy
from chatstore.store.policy.lookahead import QueueLookahead


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
        if mean_kv_bytes is not None:
            policy.kv_bytes_source = mean_kv_bytes

    def touch(self, key: Hashable) -> None:
        self._seen.add(key)
        self.policy.on_access(key)

    def forget(self, key: Hashable) -> None:
        self._seen.discard(key)
        self.policy.on_forget(key)

    def choose_victim(self, tier: str, candidates: list[Hashable]) -> Hashable | None:
        if not candidates:
            return None
        for key in candidates:
            if key not in self._seen:
                return key
        lk = QueueLookahead(self._queue())
        return min(candidates, key=lambda key: self.policy.value(key, lk))

    def prefetch_candidates(
        self, tier_of: Callable[[Hashable], str | None], top: str
    ) -> list[Hashable]:
        """Queued sessions inside the prefetch window that sit below tier `top`, soonest first."""
        head = QueueLookahead(self._queue()).head(self.policy.prefetch_window())
        return [key for key in head if tier_of(key) not in (None, top)]
