"""Placement policies: exact eviction orders, the window property, Belady against brute force."""

from __future__ import annotations

import itertools
import math
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chatstore.store.placement.policies import (
    AwarePolicy,
    BeladyPolicy,
    EvictionPolicy,
    PolicyChooser,
    QueueLookahead,
    SortedLookahead,
    make_policy,
)

NO_QUEUE = QueueLookahead()


def filled(name: str, sessions: str, size: int = 10, caps=(30, 30)) -> EvictionPolicy:
    """A policy whose tier 0 holds `sessions` (one letter each), inserted in order, used once."""
    pol = make_policy(name, caps)
    for s in sessions:
        pol.on_access(s)
        pol.on_insert(0, s, size)
    return pol


def test_lru_evicts_least_recently_used_first() -> None:
    pol = filled("lru", "abc")
    pol.on_access("a")
    assert pol.choose_victims(0, 15, NO_QUEUE) == ["b", "c"]
    assert pol.choose_victims(0, 1, NO_QUEUE) == ["b"]
    assert pol.choose_victims(0, 0, NO_QUEUE) == []


def test_lru_stamp_survives_a_move_between_tiers() -> None:
    pol = filled("lru", "abc")
    pol.on_remove(0, "a")
    pol.on_insert(1, "a", 10)  # demoted: still the oldest
    pol.on_remove(0, "b")
    pol.on_insert(1, "b", 10)
    assert pol.choose_victims(1, 20, NO_QUEUE) == ["a", "b"]
    assert pol.choose_victims(0, 10, NO_QUEUE) == ["c"]


def test_fifo_ignores_use_and_keeps_first_insert_across_resaves() -> None:
    pol = filled("fifo", "abc")
    pol.on_access("a")
    pol.on_remove(0, "a")  # a turn loads it ...
    pol.on_insert(0, "a", 12)  # ... and saves the grown KV: still first in
    assert pol.choose_victims(0, 25, NO_QUEUE) == ["a", "b", "c"]
    pol.on_remove(0, "a")
    pol.on_forget("a")  # dropped from the store: a comeback counts as new
    pol.on_insert(0, "a", 10)
    assert pol.choose_victims(0, 25, NO_QUEUE) == ["b", "c", "a"]


def test_aware_evicts_outside_window_by_lru_then_window_tail_first() -> None:
    # 5 residents x 10 B, capacities 20 + 10 -> S_kv = 10, L_ev = 3, L_pw = 2
    pol = filled("aware", "abcde", caps=(20, 10))
    queue = QueueLookahead(["c", "x", "c", "a", "e", "b"])  # window(3) = c, x, a
    assert isinstance(pol, AwarePolicy)
    assert pol.windows() == (2, 3)
    assert pol.choose_victims(0, 50, queue) == ["b", "d", "e", "a", "c"]
    assert pol.choose_victims(0, 25, queue) == ["b", "d", "e"]


def test_aware_paper_figure_9_eviction() -> None:
    """Fig. 9: all DRAM residents are queued, so DRAM evicts the window's tail (job 4); a full
    disk evicts the session queued last (job 9), outside the window."""
    pol = make_policy("aware", (30, 60))  # 9 sessions x 10 B -> L_ev = 9
    for s in (1, 2, 4):
        pol.on_access(s)
        pol.on_insert(0, s, 10)
    for s in (5, 6, 7, 8, 9, 10):
        pol.on_access(s)
        pol.on_insert(1, s, 10)
    queue = QueueLookahead([2, 3, 1, 4, 5, 6, 7, 8, 10, 9])  # window: 2 3 1 4 5 6 7 8 10
    assert pol.choose_victims(0, 10, queue) == [4]
    assert pol.choose_victims(1, 10, queue) == [9]


def test_incoming_session_that_is_worth_less_goes_lower() -> None:
    pol = filled("aware", "abc", caps=(30, 30))  # L_ev = 6: everything queued is in the window
    queue = QueueLookahead(["a", "b", "z", "c"])
    assert pol.choose_victims(0, 10, queue, incoming="z") == ["c"]  # c is needed after z
    assert pol.choose_victims(0, 10, queue, incoming="y") == ["y"]  # y is not queued: worth less
    assert filled("lru", "abc").choose_victims(0, 10, NO_QUEUE, incoming="y") == ["a"]


def test_aware_prefetches_window_sessions_that_sit_below_dram() -> None:
    pol = make_policy("aware", (20, 40))  # 3 x 10 B resident -> L_pw = 2
    pol.on_insert(0, "a", 10)
    pol.on_insert(1, "b", 10)
    pol.on_insert(1, "c", 10)
    assert pol.prefetch_candidates(QueueLookahead(["a", "b", "c"])) == ["b"]
    assert pol.prefetch_candidates(QueueLookahead(["c", "b", "a"])) == ["c", "b"]
    assert make_policy("lru").prefetch_candidates(QueueLookahead(["c"])) == []


def test_make_policy_errors() -> None:
    with pytest.raises(ValueError, match=r"unknown placement policy 'mru'.*aware, belady"):
        make_policy("mru")
    with pytest.raises(ValueError, match="capacities"):
        make_policy("aware")
    assert make_policy("LRU").name == "lru"


def test_bookkeeping_rejects_double_insert_and_wrong_tier() -> None:
    pol = filled("lru", "a")
    with pytest.raises(ValueError):
        pol.on_insert(1, "a", 10)
    with pytest.raises(ValueError):
        pol.on_remove(1, "a")
    pol.check_integrity({"a": (0, 10)})


def test_lookaheads() -> None:
    q = QueueLookahead(["b", "a", "b", "c"])
    assert (q.position("a"), q.position("z"), len(q)) == (1, None, 3)
    assert q.head(2) == ["b", "a"] and q.in_window("a", 2) and not q.in_window("c", 2)
    assert q.window_end(5) == math.inf
    s = SortedLookahead()
    for sess, key in (("a", 7), ("b", 3), ("a", 9), ("c", 5)):
        s.push(sess, key)
    assert s.head(3) == ["b", "c", "a"] and s.position("a") == 7 and s.window_end(1) == 5
    s.push("a", 1)
    s.pop("b")
    assert s.head(3) == ["a", "c"] and s.window_end(2) == math.inf


def test_chooser_adapts_a_policy_to_the_hierarchy_protocol() -> None:
    queue = ["c", "x", "a"]
    chooser = PolicyChooser(make_policy("aware", (20, 10)), lambda: queue, lambda: 10.0)
    for key in "abc":
        chooser.touch(key)
    assert chooser.choose_victim("dram", ["a", "b", "c"]) == "b"  # outside the window (L_ev 3)
    assert chooser.choose_victim("dram", ["a", "c"]) == "a"  # the window's tail
    assert chooser.choose_victim("dram", ["a", "d"]) == "d"  # never touched: found on disk
    assert chooser.choose_victim("dram", []) is None
    tiers = {"a": "ssd", "c": "dram"}
    assert chooser.prefetch_candidates(tiers.get, top="dram") == []  # L_pw = 2: c, x
    queue[:] = ["a", "c"]
    assert chooser.prefetch_candidates(tiers.get, top="dram") == ["a"]
    chooser.forget("a")
    assert chooser.choose_victim("ssd", ["a", "b"]) == "a"
    lru = PolicyChooser(make_policy("lru"))
    for key in "abca":
        lru.touch(key)
    assert lru.choose_victim("dram", ["a", "b", "c"]) == "b"
    fifo = PolicyChooser(make_policy("fifo"))
    for key in "bcab":
        fifo.touch(key)
    assert fifo.choose_victim("dram", ["a", "c", "b"]) == "b"
    assert lru.prefetch_candidates(tiers.get, top="dram") == []


# -- the window property ----------------------------------------------------------------------


@st.composite
def store_states(draw):
    n = draw(st.integers(1, 12))
    sizes = draw(st.lists(st.integers(1, 50), min_size=n, max_size=n))
    tiers = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
    uses = draw(st.permutations(range(n)))
    queue = draw(st.lists(st.integers(0, n + 4), max_size=20))  # ids >= n are not resident
    caps = (draw(st.integers(1, 200)), draw(st.integers(0, 400)))
    need = draw(st.integers(1, 300))
    return sizes, tiers, uses, queue, caps, need


@settings(max_examples=300, deadline=None)
@given(store_states(), st.sampled_from(["aware", "belady"]))
def test_window_sessions_are_never_evicted_while_one_outside_is_resident(state, name) -> None:
    sizes, tiers, uses, queue, caps, need = state
    pol = make_policy(name, caps)
    lk = QueueLookahead(queue)
    if isinstance(pol, BeladyPolicy):
        pol.bind(lk)
    for s in uses:
        pol.on_access(s)
    for s, (size, tier) in enumerate(zip(sizes, tiers, strict=True)):
        pol.on_insert(tier, s, size)
    assert isinstance(pol, AwarePolicy)
    l_ev = pol.windows()[1]
    for tier in (0, 1):
        resident = [s for s, t in enumerate(tiers) if t == tier]
        victims = pol.choose_victims(tier, need, lk)
        assert len(set(victims)) == len(victims) and set(victims) <= set(resident)
        freed = sum(sizes[v] for v in victims)
        assert freed >= need or len(victims) == len(resident)
        assert freed - sizes[victims[-1]] < need if victims else True  # no more than needed
        if name == "belady":
            far = [math.inf if lk.position(v) is None else lk.position(v) for v in victims]
            assert far == sorted(far, reverse=True), "belady: not furthest next use first"
            continue
        inside = [lk.in_window(v, l_ev) for v in victims]
        outside_left = [s for s in resident if s not in victims and not lk.in_window(s, l_ev)]
        assert not (any(inside) and outside_left), "evicted a window session, kept an outside one"
        assert inside == sorted(inside), "a window session went before an outside one"
        tail = [lk.position(v) for v, i in zip(victims, inside, strict=True) if i]
        assert tail == sorted(tail, reverse=True), "window sessions not taken tail first"


# -- Belady against brute force ---------------------------------------------------------------


def belady_misses(trace: tuple[int, ...], capacity: int) -> int:
    """Unit-size sessions, one tier; a turn loads its session and saves it back (or bypasses)."""
    pol = make_policy("belady", (capacity,))
    future = SortedLookahead()
    assert isinstance(pol, BeladyPolicy)
    pol.bind(future)
    for i in range(len(trace) - 1, -1, -1):
        future.push(trace[i], i)
    misses = 0
    for i, s in enumerate(trace):
        future.pop(s)
        nxt = next((j for j in range(i + 1, len(trace)) if trace[j] == s), None)
        if nxt is not None:
            future.push(s, nxt)
        if pol.tier_of(s) is None:
            misses += 1
        else:
            pol.on_remove(0, s)
        pol.on_access(s)
        victims = pol.choose_victims(0, pol.used(0) + 1 - capacity, future, incoming=s)
        if victims == [s]:
            continue
        for v in victims:
            pol.on_remove(0, v)
        pol.on_insert(0, s, 1)
    return misses


def optimal_misses(trace: tuple[int, ...], capacity: int) -> int:
    @cache
    def best(i: int, held: frozenset[int]) -> int:
        if i == len(trace):
            return 0
        s = trace[i]
        miss = s not in held
        pool = held | {s}
        keep = min(capacity, len(pool))
        return miss + min(best(i + 1, frozenset(c)) for c in itertools.combinations(pool, keep))

    return best(0, frozenset())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=10), st.integers(1, 3))
def test_belady_is_optimal_for_unit_sizes(trace, capacity) -> None:
    assert belady_misses(tuple(trace), capacity) == optimal_misses(tuple(trace), capacity)


# -- retention priority -------------------------------------------------------------------------


def prioritised(name: str, priorities: dict[str, int], caps=(40, 40)) -> EvictionPolicy:
    """Tier 0 holds a, b, c, d (10 B each; inserted and used in that order, so `a` is the
    oldest and idlest); belady's future queues d, then b (a and c never run again)."""
    pol = make_policy(name, caps)
    if isinstance(pol, BeladyPolicy):
        pol.bind(QueueLookahead(["d", "b"]))
    for s in "abcd":
        pol.on_access(s)
        pol.on_insert(0, s, 10)
    for s, p in priorities.items():
        pol.set_priority(s, p)
    return pol


@pytest.mark.parametrize("name", ["lru", "fifo", "aware", "belady"])
def test_a_high_priority_idle_session_stays_while_lower_ones_move_down(name) -> None:
    # Without priorities every policy here evicts a first (oldest, or never used again).
    assert prioritised(name, {}).choose_victims(0, 10, NO_QUEUE) == ["a"]
    pol = prioritised(name, {"a": 5, "c": -1})
    # c (-1) first, then priority 0 in the policy's own order (b before d), a (5) last; when
    # only high-priority sessions are left they still go: priority never overfills a tier.
    assert pol.choose_victims(0, 10, NO_QUEUE) == ["c"]
    assert pol.choose_victims(0, 30, NO_QUEUE) == ["c", "b", "d"]
    assert pol.choose_victims(0, 40, NO_QUEUE) == ["c", "b", "d", "a"]
    # An incoming session worth less than every resident goes one tier lower instead ...
    assert pol.choose_victims(0, 10, NO_QUEUE, incoming="z") == ["c"]
    pol.set_priority("z", -5)
    assert pol.choose_victims(0, 10, NO_QUEUE, incoming="z") == ["z"]
    # ... and a high-priority one displaces the lowest resident, not the one it outranks least.
    pol.set_priority("z", 10)
    assert pol.choose_victims(0, 20, NO_QUEUE, incoming="z") == ["c", "b"]
    pol.set_priority("a", 0)  # back to the default: the policy's own order again
    pol.set_priority("c", 0)
    assert pol.choose_victims(0, 10, NO_QUEUE) == ["a"]


def test_priority_outranks_the_look_ahead_window() -> None:
    pol = prioritised("aware", {}, caps=(20, 20))  # S_kv 10 -> L_ev 4: all queued inside
    queue = QueueLookahead(["b", "c", "d"])  # a is idle, the others run next
    assert pol.choose_victims(0, 10, queue) == ["a"]  # a is outside the window
    pol.set_priority("a", 3)
    assert pol.choose_victims(0, 40, queue) == ["d", "c", "b", "a"]  # window tail first, then a


def test_priority_survives_forget_and_reaches_the_chooser() -> None:
    chooser = PolicyChooser(make_policy("lru"))
    for key in "abc":
        chooser.touch(key)
    chooser.set_priority("a", 2)
    chooser.set_priority("d", -1)  # never touched (found on disk): goes first only in its class
    assert chooser.rank("dram", ["a", "b", "c", "d", "e"]) == ["d", "e", "b", "c", "a"]
    assert chooser.choose_victim("dram", ["a", "b"]) == "b"
    assert chooser.ranked_below("b", ["a", "c", "d", "e"]) == ["d", "e"]
    assert chooser.ranked_below("a", ["b", "c"]) == ["b", "c"]
    chooser.forget("a")  # its KV left the store; the client's priority stays
    assert chooser.rank("dram", ["a", "b"]) == ["b", "a"]
