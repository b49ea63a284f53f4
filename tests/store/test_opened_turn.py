"""One turn's handle (store/opened_turn.py): what the API opens travels with the turn, nothing is
found again by session key.

- TurnChain, the future a commit completes and the API's append takes: once each, a stale
  chain is not taken, a turn given up before or after its commit is recorded by the store.
- Over a real store (LMDB records, async save on the writer thread): a turn opened by the API
  is recorded by the append alone, with exactly the chain the index holds; an aborted turn's
  chain is recorded by the store; a session deleted after the opening keeps nothing, and its
  append does not wait for a commit that never comes; an engine that saved nothing lets the
  append go at once.
"""

from __future__ import annotations

import threading
import time

import torch

from chatstore.store.attention_store import AttentionStore
from chatstore.store.opened_turn import TurnChain
from chatstore.store.ports import ChainRecord, OpenedTurn
from chatstore.store.records.record import SessionRecord
from chatstore.store.session_kv import SessionKey, SessionKV
from chatstore.store.session_store import SessionStore
from chatstore.store.settings import StoreSettings
from tests.support.store import TINY_SPEC

TOKEN_BYTES = 2 * 2 * 2 * 4 * 4  # fp32 bytes of one token's K and V over all layers
CHAIN = ChainRecord([1, 2, 3], ["c0"], "fp")


def test_a_chain_is_taken_once_it_is_completed() -> None:
    chain = TurnChain()
    threading.Timer(0.05, lambda: chain.complete(CHAIN)).start()
    assert chain.take(timeout=10) == CHAIN  # waits for the commit
    assert chain.give_up() is None  # taken: nothing left for the store to record


def test_a_stale_chain_is_not_taken() -> None:
    chain = TurnChain()
    assert chain.complete(CHAIN, current=lambda: False)  # a later turn replaced it
    assert chain.take(timeout=0) is None


def test_nothing_saved_lets_the_append_go_at_once() -> None:
    chain = TurnChain()
    chain.complete(None)
    t0 = time.monotonic()
    assert chain.take(timeout=30) is None
    assert time.monotonic() - t0 < 5  # a liveness bound: no wait for a commit


def test_a_turn_given_up_is_recorded_by_the_store() -> None:
    before = TurnChain()
    assert before.give_up() is None  # not committed yet: the commit records it
    assert before.complete(CHAIN) is False
    after = TurnChain()
    assert after.complete(CHAIN) is True  # committed: the API's to take
    given = after.give_up()
    assert given is not None and given[0] == CHAIN  # the store records it now
    assert after.take(timeout=0) is None


# -- over a real store ---------------------------------------------------------------------------


def kv(ids: list[int], seed: int = 0) -> SessionKV:
    g = torch.Generator().manual_seed(seed)
    return SessionKV(ids, torch.randn((2, 2, len(ids), 2, 4), generator=g))


def make(tmp_path) -> tuple[AttentionStore, SessionStore]:
    settings = StoreSettings(
        data_dir=tmp_path, dram_bytes=64 * 16 * TOKEN_BYTES, ssd_bytes=1 << 20, async_save=True
    )
    store = AttentionStore(settings, TINY_SPEC, "fp")
    return store, SessionStore(store.records, store)


def engine_saves(
    store: AttentionStore, opened: OpenedTurn, ids: list[int], gate: threading.Event | None = None
) -> None:
    """What the connector does at the turn's end: the whole history as the session's chain,
    built on the writer thread (once `gate` is set), with the turn's handle."""
    stored = store.find(opened.key.tenant, opened.key.session_id)
    value = kv(ids)
    reusable = stored.num_tokens if stored is not None else 0
    plan = store.plan_turn(opened.key.tenant, ids, stored, reusable)

    def build() -> dict:
        if gate is not None:
            gate.wait(10)
        spans = plan.new_spans()
        return {k: SessionKV(ids[a:b], value.kv[:, :, a:b].clone()) for _, k, a, b in spans}

    tenant, sid = opened.key.tenant, opened.key.session_id
    store.save_plan(tenant, sid, plan, build, value.nbytes, opened=opened)


def new_session(sessions: SessionStore, sid: str) -> SessionRecord:
    record = SessionRecord("t", sid)
    assert sessions.create(record)
    return record


def test_the_append_records_the_chain_the_commit_made(tmp_path) -> None:
    store, sessions = make(tmp_path)
    try:
        record = new_session(sessions, "s")
        ids = list(range(40))
        opened = sessions.open_turn("t", "s", ids)
        assert opened is not None and opened.chain is not None
        engine_saves(store, opened, ids)
        assert store.flush_writes(30)
        assert store.records.get(SessionKey("t", "s")).chunks == []  # the commit left it to us
        sessions.append_turn(record, [{"role": "user", "content": "hi"}], turn=opened)
        chain = store.index.get(SessionKey("t", "s"))
        assert record.chunks == [c.digest for c in chain.chunks]
        assert record.token_ids == ids and record.fingerprint == "fp"
        sessions.end_turn(opened)  # nothing left to record or unpin
        assert store.flush_writes(30) and not store.pins
    finally:
        sessions.close()


def test_an_aborted_turn_is_recorded_by_the_store(tmp_path) -> None:
    """The turn's commit landed, then the client went away: no append. The API ends the turn
    on its event loop; the writer thread records the chain (a restart reuses it)."""
    store, sessions = make(tmp_path)
    try:
        new_session(sessions, "s")
        ids = list(range(40))
        opened = sessions.open_turn("t", "s", ids)
        engine_saves(store, opened, ids)
        assert store.flush_writes(30)
        sessions.end_turn(opened)
        assert store.flush_writes(30)
        saved = store.records.get(SessionKey("t", "s"))
        chain = store.index.get(SessionKey("t", "s"))
        assert saved.token_ids == ids and saved.chunks == [c.digest for c in chain.chunks]
    finally:
        sessions.close()


def test_a_turn_given_up_before_its_commit_is_recorded_by_the_commit(tmp_path) -> None:
    store, sessions = make(tmp_path)
    gate = threading.Event()
    try:
        new_session(sessions, "s")
        ids = list(range(40))
        opened = sessions.open_turn("t", "s", ids)
        engine_saves(store, opened, ids, gate)  # its chunks wait to be built
        sessions.end_turn(opened)  # before the commit ran
        assert not opened.chain.completed
        gate.set()
        assert store.flush_writes(30)
        assert store.records.get(SessionKey("t", "s")).token_ids == ids
    finally:
        gate.set()
        sessions.close()


def test_a_session_deleted_after_its_turn_opened_keeps_nothing(tmp_path) -> None:
    store, sessions = make(tmp_path)
    try:
        record = new_session(sessions, "s")
        ids = list(range(40))
        opened = sessions.open_turn("t", "s", ids)
        assert sessions.delete("t", "s")
        engine_saves(store, opened, ids)  # the turn ends after the delete
        assert store.flush_writes(30)
        assert store.index.get(SessionKey("t", "s")) is None
        t0 = time.monotonic()
        assert opened.chain.take(timeout=30) is None
        assert time.monotonic() - t0 < 5  # a liveness bound: the dropped save completed it
        assert record.session_id == "s"
    finally:
        sessions.close()


def test_an_engine_that_saved_nothing_lets_the_append_go(tmp_path) -> None:
    _, sessions = make(tmp_path)
    try:
        record = new_session(sessions, "s")
        opened = sessions.open_turn("t", "s", [1, 2, 3])
        opened.nothing_saved()  # the connector: no tokens to save
        t0 = time.monotonic()
        sessions.append_turn(record, [{"role": "user", "content": "hi"}], turn=opened)
        assert time.monotonic() - t0 < 5  # a liveness bound
        assert len(record.messages) == 1 and record.chunks == []
    finally:
        sessions.close()


def test_a_turn_ended_after_the_store_closed_does_not_raise(tmp_path) -> None:
    """A server shutting down: the event loop ends a turn whose chain no append took after the
    writer stopped; the record keeps its previous chain (the KV is a cache), nothing raises."""
    store, sessions = make(tmp_path)
    new_session(sessions, "s")
    ids = list(range(40))
    opened = sessions.open_turn("t", "s", ids)
    engine_saves(store, opened, ids)
    assert store.flush_writes(30)
    store.writer.close()
    sessions.end_turn(opened)
    sessions.close()


def test_an_ended_turn_does_not_keep_the_store_alive(tmp_path) -> None:
    """A handle outlives its turn (a request a test or a metrics history keeps): once ended,
    it holds nothing of the store, so a stopped server's tiers are freed (each server a test
    started stayed alive through its handles: 0.9 GB a server, the suite was OOM-killed)."""
    import gc
    import weakref

    store, sessions = make(tmp_path)
    new_session(sessions, "s")
    ids = list(range(40))
    opened = sessions.open_turn("t", "s", ids)
    engine_saves(store, opened, ids)
    assert store.flush_writes(30)
    sessions.end_turn(opened)
    sessions.close()
    gone = weakref.ref(store)
    del store, sessions
    gc.collect()
    assert gone() is None, "an ended turn's handle keeps the store alive"
    assert opened.key.session_id == "s"
