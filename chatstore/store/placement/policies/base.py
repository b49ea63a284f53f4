"""The abstract eviction/prefetch policy over an N-level store whose unit is one session's KV.

Tiers are numbered from the top: 0 = DRAM, 1 = SSD, 2 = remote, ... The policy only *decides*;
the tier manager acts, and tells the policy what happened through the bookkeeping hooks:

    on_access(s)          a turn used session s (hit or miss); call before re-inserting it
    on_insert(t, s, n)    s now lives in tier t with n bytes (saved, demoted or promoted)
    on_remove(t, s)       s left tier t (loaded for a turn, demoted, promoted or dropped)
    on_forget(s)          s is gone from the whole store (dropped off the last tier, deleted)

Decisions:

    choose_victims(t, need, lookahead, incoming)   whom to move out of tier t to free `need` bytes
    prefetch_candidates(lookahead)                 sessions worth bringing up to tier 0 now

Every policy ranks sessions by a *value* (higher = keep); victims are taken lowest value first.
The value is (priority, the policy's own order value): a session's priority (`set_priority`,
retention.py) outranks recency and the look-ahead, so a tier gives up every lower-priority
resident before a higher one, in the policy's own order inside one priority.
With `incoming` set (the session about to enter the tier), a policy never evicts a session it
values at least as much as the incoming one: it answers `[incoming]` instead, meaning "put the
incoming session one tier lower" (or, for a prefetch, "do not bring it up").

Not thread-safe: the tier manager calls it under the lock that guards its own residency.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Hashable, Mapping, Sequence
from typing import Any, ClassVar

from chatstore.store.placement.policies.lookahead import Lookahead


class EvictionPolicy(ABC):
    """Base: residency bookkeeping shared by all policies, plus the victim-selection loop."""

    name: ClassVar[str]
    # True when (a) without the look-ahead a session's value changes only through on_access,
    # on_forget and set_priority, and (b) the look-ahead changes only queued sessions' values
    # and only raises them. Eviction then keeps each chunk's rank as those calls come
    # (placement/chunk_ranks.py) instead of ranking every owner of every chunk each time.
    queue_local: ClassVar[bool] = False

    def __init__(self, capacities: Sequence[int] = ()) -> None:
        """`capacities`: bytes per tier, top first (used by look-ahead policies for windows)."""
        self.capacities = tuple(int(c) for c in capacities)
        self._tier: dict[Hashable, int] = {}
        self._size: dict[Hashable, int] = {}
        self._used: dict[int, int] = {}
        self._clock = itertools.count()
        self._priority: dict[Hashable, int] = {}  # only sessions whose priority is not 0
        self.kv_bytes_source: Callable[[], float] | None = None

    # -- bookkeeping -------------------------------------------------------------------------

    @abstractmethod
    def on_access(self, session: Hashable) -> None:
        """A turn used `session` (whether or not its KV was resident)."""

    def on_insert(self, tier: int, session: Hashable, size: int) -> None:
        if session in self._tier:
            raise ValueError(f"{session!r} is already resident in tier {self._tier[session]}")
        self._tier[session] = tier
        self._size[session] = size
        self._used[tier] = self._used.get(tier, 0) + size
        self._inserted(tier, session)

    def on_remove(self, tier: int, session: Hashable) -> None:
        if self._tier.get(session) != tier:
            raise ValueError(f"{session!r} is not resident in tier {tier}")
        del self._tier[session]
        self._used[tier] -= self._size.pop(session)
        self._removed(tier, session)

    @abstractmethod
    def on_forget(self, session: Hashable) -> None:
        """The session left the store for good: drop whatever the policy remembers of its use
        (not its priority: the client's setting outlives its KV; `set_priority(s, 0)` clears)."""

    def set_priority(self, session: Hashable, priority: int) -> None:
        """The session's retention priority (0 = default; higher stays up longer)."""
        if priority:
            self._priority[session] = priority
        else:
            self._priority.pop(session, None)

    def priority(self, session: Hashable) -> int:
        return self._priority.get(session, 0)

    # -- queries -----------------------------------------------------------------------------

    def tier_of(self, session: Hashable) -> int | None:
        return self._tier.get(session)

    def size_of(self, session: Hashable) -> int:
        return self._size[session]

    def used(self, tier: int) -> int:
        return self._used.get(tier, 0)

    def mean_kv_bytes(self) -> float:
        """S_kv: the mean size of a resident session's KV (0 when the store is empty).

        `kv_bytes_source`, when set, answers instead (a caller that does not report residency).
        """
        if self.kv_bytes_source is not None:
            return self.kv_bytes_source()
        return sum(self._used.values()) / len(self._size) if self._size else 0.0

    # -- decisions ---------------------------------------------------------------------------

    def choose_victims(
        self,
        tier: int,
        bytes_needed: int,
        lookahead: Lookahead,
        incoming: Hashable | None = None,
    ) -> list[Hashable]:
        """Sessions to move out of `tier` (in order) so that `bytes_needed` bytes come free.

        Returns `[incoming]` when making room would evict a session valued at least as much as
        `incoming`; returns every resident of the tier if even that frees too little.
        """
        victims: list[Hashable] = []
        if bytes_needed <= 0:
            return victims
        keep_over = None if incoming is None else self.value(incoming, lookahead)
        ranked = self._ranked(tier, lookahead)
        try:
            # Priority classes, lowest first; sorted() is stable, so the policy's own order
            # holds inside each class. Without priorities the generator stays lazy.
            order = sorted(ranked, key=self.priority) if self._priority else ranked
            freed = 0
            for s in order:
                if s == incoming:
                    continue
                if keep_over is not None and self.value(s, lookahead) >= keep_over:
                    return [incoming]
                victims.append(s)
                freed += self._size[s]
                if freed >= bytes_needed:
                    break
        finally:
            ranked.close()
        return victims

    def prefetch_candidates(self, lookahead: Lookahead) -> list[Hashable]:
        """Sessions below tier 0 worth promoting now, soonest first. Baselines: none."""
        return []

    def prefetch_window(self) -> int:
        """How many queued sessions prefetch looks at (L_pw). Baselines: 0."""
        return 0

    def value(self, session: Hashable, lookahead: Lookahead) -> tuple[int, Any]:
        """How much keeping `session` is worth; comparable across sessions, higher = keep."""
        return self.priority(session), self.order_value(session, lookahead)

    @abstractmethod
    def order_value(self, session: Hashable, lookahead: Lookahead) -> Any:
        """The policy's own value of `session`, priority aside (higher = keep)."""

    @abstractmethod
    def _ranked(self, tier: int, lookahead: Lookahead) -> Generator[Hashable, None, None]:
        """Residents of `tier`, lowest order value first, priority aside (a generator; it may
        be closed early)."""

    # -- subclass hooks: keep the policy's own order of each tier ----------------------------

    @abstractmethod
    def _inserted(self, tier: int, session: Hashable) -> None:
        """Called after `session` became resident in `tier`."""

    @abstractmethod
    def _removed(self, tier: int, session: Hashable) -> None:
        """Called after `session` left `tier`."""

    def check_integrity(self, resident: Mapping[Hashable, tuple[int, int]] | None = None) -> None:
        """Assert internal consistency; with `resident` ({s: (tier, size)}), agreement with it."""
        per_tier: dict[int, int] = {}
        for s, t in self._tier.items():
            per_tier[t] = per_tier.get(t, 0) + self._size[s]
        assert all(self._used.get(t, 0) == n for t, n in per_tier.items()), "used bytes drifted"
        if resident is not None:
            mine = {s: (t, self._size[s]) for s, t in self._tier.items()}
            assert mine == dict(resident), "policy residency differs from the tiers'"
