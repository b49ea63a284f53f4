"""Scheduler-aware eviction and fetch wired into the AttentionStore (CachedAttention §3.3)."""

from __future__ import annotations

import random
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatstore.config import load_config
from chatstore.store.attention_store import AttentionStore
from chatstore.store.placement.policies import PolicyChooser
from chatstore.store.port_values import StoreEvent
from chatstore.store.session_kv import SessionKey
from chatstore.store.settings import StoreSettings
from tests.support.store import BLOCK, TINY_SPEC, evictions, lookup, push_down, session_of, value


def make(tmp_path, policy: str = "aware", dram_sessions: int = 2, **kw) -> AttentionStore:
    kw.setdefault("ssd_bytes", 1 << 20)
    kw.setdefault("prefetch_interval_s", 0.01)
    settings = StoreSettings(
        data_dir=tmp_path, dram_bytes=dram_sessions * BLOCK, policy=policy, **kw
    )
    return AttentionStore(settings, TINY_SPEC, "fp")


def key(sid: str) -> SessionKey:
    return SessionKey("t", sid)


def wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


# -- eviction ---------------------------------------------------------------------------------


def test_config_policy_key(tmp_path):
    assert load_config(env={}).policy == "aware"
    config = load_config(env={"CHATSTORE_POLICY": "fifo", "CHATSTORE_DATA_DIR": str(tmp_path)})
    assert config.policy == "fifo"
    assert StoreSettings.from_config(config).policy == "fifo"
    with pytest.raises(ValueError, match="policy"):
        load_config(env={"CHATSTORE_POLICY": "random"})


def test_store_uses_policy_chooser(tmp_path):
    store = make(tmp_path)
    assert isinstance(store.session_policy, PolicyChooser)
    assert store.session_policy.policy.name == "aware"
    store.close()


def test_aware_evicts_the_session_outside_the_queue(tmp_path):
    store = make(tmp_path, "aware")
    evicted = evictions(store)
    store.save("t", "a", value(16, 1))  # a is the least recently used ...
    store.save("t", "b", value(16, 2))
    store.set_waiting_queue(lambda: [key("a")])  # ... but its next turn is queued
    store.save("t", "c", value(16, 3))
    assert evicted == [key("b")]
    assert store.tier_of("t", "a") == "dram"
    assert store.tier_of("t", "b") == "ssd"
    assert store.tier_of("t", "c") == "dram"
    store.close()


def test_lru_evicts_the_queued_session(tmp_path):
    store = make(tmp_path, "lru")
    evicted = evictions(store)
    store.save("t", "a", value(16, 1))
    store.save("t", "b", value(16, 2))
    store.set_waiting_queue(lambda: [key("a")])
    store.save("t", "c", value(16, 3))
    assert evicted == [key("a")]
    store.close()


def test_aware_evicts_the_window_tail_first(tmp_path):
    store = make(tmp_path, "aware")
    evicted = evictions(store)
    store.save("t", "a", value(16, 1))
    store.save("t", "b", value(16, 2))
    store.set_waiting_queue(lambda: [key("c"), key("b"), key("a")])  # all queued: a runs last
    store.save("t", "c", value(16, 3))
    assert evicted == [key("a")]
    store.close()


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    saves=st.lists(st.tuples(st.integers(0, 7), st.integers(1, 40)), min_size=1, max_size=25),
    queue=st.lists(st.integers(0, 7), max_size=8, unique=True),
)
def test_queued_sessions_are_evicted_only_when_nothing_else_is_left(tmp_path, saves, queue):
    """At every DRAM eviction: a queued victim means every other DRAM resident but the incoming
    session is queued too (the eviction window covers the whole queue: SSD is large)."""
    store = make(tmp_path / f"p{random.getrandbits(64):x}", "aware", dram_sessions=5)
    store.prefetcher.close()  # only saves move sessions here: `incoming` is the one arriving
    queued = {key(str(q)) for q in queue}
    store.set_waiting_queue(lambda: [key(str(q)) for q in queue])
    incoming: list[SessionKey] = []
    dram = store.tier("dram")
    assert dram is not None
    bad: list[str] = []

    def listen(e: StoreEvent) -> None:
        victim = session_of(store, e.key)
        if e.kind == "evicted" and e.tier == "dram" and victim in queued:
            others = {session_of(store, c) for c in dram.keys()} - {incoming[-1], None}  # noqa: SIM118
            if others - queued:
                bad.append(f"evicted queued {victim} while {others - queued} were resident")

    store.add_listener(listen)
    try:
        for i, (sid, tokens) in enumerate(saves):
            incoming.append(key(str(sid)))
            store.save("t", str(sid), value(tokens, i))
            store.tiers.check_capacity()
        assert not bad, bad
    finally:
        store.close()


# -- fetch ------------------------------------------------------------------------------------


def prefetch(store: AttentionStore, sid: str) -> bool:
    """One prefetch of the session's chunks, as the prefetch thread does it."""
    return store.opening.prefetch_session(key(sid), False) > 0


def demoted(store: AttentionStore, sid: str, seed: int = 1) -> None:
    store.save("t", sid, value(16, seed))
    push_down(store, "t", sid)
    assert store.tier_of("t", sid) == "ssd"


@pytest.mark.parametrize("policy", ["aware", "lru", "fifo"])
def test_prefetch_hint_moves_a_session_up(tmp_path, policy):
    store = make(tmp_path, policy)
    demoted(store, "a")
    store.prefetch("t", "a")
    assert wait_for(lambda: store.tier_of("t", "a") == "dram")
    assert store.stats().counters.prefetches == 1
    assert lookup(store, "t", "a").equal(value(16, 1))
    store.close()


def test_queued_session_is_prefetched(tmp_path):
    store = make(tmp_path, "aware")
    demoted(store, "a")
    store.save("t", "b", value(16, 2))
    queue: list[SessionKey] = []
    store.set_waiting_queue(lambda: list(queue))
    time.sleep(0.05)
    assert store.tier_of("t", "a") == "ssd"  # not queued: stays down
    queue.append(key("a"))
    assert wait_for(lambda: store.tier_of("t", "a") == "dram")
    assert store.stats().counters.prefetches >= 1
    assert store.tier_of("t", "b") == "dram"  # room enough: nothing pushed out
    store.close()


def test_lru_does_not_prefetch_from_the_queue(tmp_path):
    store = make(tmp_path, "lru")
    demoted(store, "a")
    store.set_waiting_queue(lambda: [key("a")])
    store.prefetcher.run_once()
    assert store.tier_of("t", "a") == "ssd"
    store.close()


def test_prefetch_races_with_lookups(tmp_path):
    """The prefetch thread moving sessions up and down while this thread looks them up:
    every lookup returns the complete, right value."""
    store = make(tmp_path, "aware", dram_sessions=2)
    values = {str(i): value(16 + 8 * i, i) for i in range(5)}
    for sid, v in values.items():
        store.save("t", sid, v)
    stop = threading.Event()

    def hints() -> None:
        rng = random.Random(0)
        while not stop.is_set():
            store.prefetch("t", str(rng.randrange(5)))
            time.sleep(0.001)

    thread = threading.Thread(target=hints)
    thread.start()
    try:
        rng = random.Random(1)
        deadline = time.monotonic() + 1.0
        n = 0
        while time.monotonic() < deadline:
            sid = str(rng.randrange(5))
            got = lookup(store, "t", sid)
            assert got is not None and got.equal(values[sid])
            store.tiers.check_capacity()
            n += 1
        assert n > 10
    finally:
        stop.set()
        thread.join()
        store.close()
    assert store.prefetcher.moved > 0


def test_prefetch_does_not_push_out_a_session_queued_sooner(tmp_path):
    store = make(tmp_path, "aware", dram_sessions=1)
    store.prefetcher.close()  # rounds run by hand below
    demoted(store, "b", 2)
    store.save("t", "a", value(16, 1))  # a fills DRAM
    store.set_waiting_queue(lambda: [key("a"), key("b")])
    assert prefetch(store, "b") is False  # would push a (runs first) out
    assert store.tier_of("t", "a") == "dram"
    store.set_waiting_queue(lambda: [key("b"), key("a")])
    assert prefetch(store, "b") is True  # b runs first now: a moves down
    assert store.tier_of("t", "a") == "ssd"
    store.close()


def test_queued_session_from_before_a_restart_is_prefetched(tmp_path):
    store = make(tmp_path, "aware", dram_sessions=1)
    store.save("t", "a", value(16, 1))
    store.close()  # a moves to LMDB; the new process has never seen it used
    store = make(tmp_path, "aware", dram_sessions=1)
    store.prefetcher.close()
    store.save("t", "b", value(16, 2))  # DRAM full of a session nobody waits for
    store.set_waiting_queue(lambda: [key("a")])
    assert prefetch(store, "a") is True
    assert store.tier_of("t", "b") == "ssd"
    assert lookup(store, "t", "a").equal(value(16, 1))
    store.close()
