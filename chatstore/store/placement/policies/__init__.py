"""Placement policies for the session KV store: which session leaves a tier, which comes up.

    policy = make_policy("aware", capacities=[dram_bytes, ssd_bytes])

`lru` and `fifo` are the baselines, `aware` is CachedAttention's scheduler-aware eviction and
prefetch; `belady` (needs the whole future) is the simulator's reference bound.
"""

from __future__ import annotations

from collections.abc import Sequence

from chatstore.store.placement.policies.aware import AwarePolicy
from chatstore.store.placement.policies.base import EvictionPolicy
from chatstore.store.placement.policies.belady import BeladyPolicy
from chatstore.store.placement.policies.chooser import PolicyChooser
from chatstore.store.placement.policies.fifo import FIFOPolicy
from chatstore.store.placement.policies.lookahead import Lookahead, QueueLookahead, SortedLookahead
from chatstore.store.placement.policies.lru import LRUPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    p.name: p for p in (LRUPolicy, FIFOPolicy, AwarePolicy, BeladyPolicy)
}


def make_policy(name: str, capacities: Sequence[int] = ()) -> EvictionPolicy:
    """The policy called `name` for tiers of `capacities` bytes (top first)."""
    try:
        cls = POLICIES[name.lower()]
    except KeyError:
        known = ", ".join(sorted(POLICIES))
        raise ValueError(f"unknown placement policy {name!r}; choose one of: {known}") from None
    return cls(capacities)


__all__ = [
    "POLICIES",
    "AwarePolicy",
    "BeladyPolicy",
    "EvictionPolicy",
    "FIFOPolicy",
    "LRUPolicy",
    "Lookahead",
    "PolicyChooser",
    "QueueLookahead",
    "SortedLookahead",
    "make_policy",
]
