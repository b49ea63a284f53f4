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

For eviction over chunks without ranking every owner each time (placement/chunk_ranks.py), a
chooser whose policy is `queue_local` also answers a session's rank without the queue
(`rank_key`), the queued sessions whose rank the queue changes (`queued_rank_keys`), and tells
its watchers each session whose rank may have changed (`watch`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from chatstore.store.placement.policies.base import EvictionPolicy
from chatstore.store.placement.policies.lookahead import Lookahead, QueueLookahead

RankKey = tuple[int, bool, Any]  # (priority, touched, the policy's value): lower goes first
_NO_QUEUE = QueueLookahead()


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
        self._watchers: list[Callable[[Hashable], None]] = []
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

    def watch(self, watcher: Callable[[Hashable], None]) -> None:
        """watcher is told each session whose rank may have changed (after the change)."""
        self._watchers.append(watcher)

    def _changed(self, key: Hashable) -> None:
        for watcher in self._watchers:
            watcher(key)

    def touch(self, key: Hashable) -> None:
        self._seen.add(key)
        self.policy.on_access(key)
        self._changed(key)

    def forget(self, key: Hashable) -> None:
        self._seen.discard(key)
        self.policy.on_forget(key)
        self._changed(key)

    def set_priority(self, key: Hashable, priority: int) -> None:
        self.policy.set_priority(key, priority)
        self._changed(key)

    @property
    def ranks_incrementally(self) -> bool:
        """Whether `rank_key` changes only when a watcher is told, and the queue only raises
        the sessions it holds (the policy is queue_local)."""
        return self.policy.queue_local

    def rank_key(self, key: Hashable) -> RankKey:
        """key's rank with nothing queued (lower goes first)."""
        return self._rank_key(key, _NO_QUEUE)

    def queued_rank_keys(self) -> dict[Hashable, RankKey]:
        """The queued sessions the queue ranks otherwise than `rank_key`, with the rank it
        gives them (one decision's: the queue is read once)."""
        lk = QueueLookahead(self._queue())
        if not len(lk):
            return {}
        with self._pinned():
            ranked = {key: self._rank_key(key, lk) for key in lk}
        return {key: rank for key, rank in ranked.items() if rank != self._rank_key(key, _NO_QUEUE)}

    def _rank_key(self, key: Hashable, lk: Lookahead) -> RankKey:
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
