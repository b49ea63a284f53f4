"""Store v2 at the store level: chunk keys, sharing, reference counts, what a turn writes, and a
random walk of create / turn / fork / delete / evict / expire / restart that must never leak a
chunk, free one still referenced, or serve bytes other than a session's own.

KV values here are a pure function of (token id, position) (tests/support/chunk_store.py): a
chunk's content is then fixed by its tokens and its place in the history, as real KV is by the
chain its key hashes."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import uuid

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatstore.store.attention_store import AttentionStore
from chatstore.store.chunks import ChunkHasher
from chatstore.store.session_kv import SessionKey, SessionKV
from tests.support.chunk_store import CHUNK, kv_of, make, turn
from tests.support.store import TOKEN_BYTES, lookup, push_down


def check_invariants(store: AttentionStore, expected: dict[SessionKey, list[int]]) -> None:
    store.flush_writes(10)
    referenced = store.index.chunks()
    stored = store.tiers.keys()
    assert stored == referenced, f"leaked {stored - referenced}, lost {referenced - stored}"
    for tier in store.tiers.tiers:
        assert tier.used_bytes() == sum(tier.size_of(k) for k in tier.keys())  # noqa: SIM118
        assert tier.used_bytes() <= tier.capacity
    assert set(store.index.sessions()) == set(expected)
    for key, ids in expected.items():
        got = lookup(store, key.tenant, key.session_id)
        assert got is not None and got.token_ids == ids
        assert torch.equal(got.kv, kv_of(ids)), f"{key}: bytes of another history"


def test_keys_are_stable_chained_and_per_tenant():
    hasher = ChunkHasher("fp", torch.float32, 4)
    ids = list(range(10))
    keys = hasher.chain("t", ids)
    assert len(keys) == 3 and keys == hasher.chain("t", ids)
    assert hasher.chain("t", ids[:8]) == keys[:2]  # a prefix shares its full chunks
    assert hasher.chain("t", [99, *ids[1:]])[1] != keys[1]  # the chain: depends on the parent
    assert not set(hasher.chain("other", ids)) & set(keys)  # tenants never share
    assert ChunkHasher("fp", torch.bfloat16, 4).chain("t", ids)[0] != keys[0]
    assert hasher.chain("t", ids[4:], parent=keys[0]) == keys[1:]
    # Stable across processes (no salted hash): a fresh interpreter computes the same digest.
    code = (
        "import torch; from chatstore.store.chunks import ChunkHasher; "
        "print(ChunkHasher('fp', torch.float32, 4).chain('t', list(range(10)))[2].digest)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == keys[2].digest


def test_a_turn_writes_only_its_new_chunks(tmp_path):
    store = make(tmp_path)
    ids = list(range(100, 120))  # 2 full chunks + a tail of 4
    turn(store, "t", "s", ids)
    assert store.bytes_written == 20 * TOKEN_BYTES
    before = store.bytes_written
    ids += list(range(200, 206))  # completes the tail (4 old + 4 new) and a tail of 2
    turn(store, "t", "s", ids)
    # Only the 6 new rows: the old tail's blocks are extended in place in DRAM.
    assert store.bytes_written - before == 6 * TOKEN_BYTES
    check_invariants(store, {SessionKey("t", "s"): ids})
    store.close()


def test_a_tail_held_by_a_fork_is_copied_not_taken(tmp_path):
    store = make(tmp_path)
    ids = list(range(100, 112))  # a full chunk and a tail of 4
    turn(store, "t", "a", ids)
    turn(store, "t", "b", ids)  # a fork: holds the same tail
    before = store.bytes_written
    turn(store, "t", "a", [*ids, 7, 8, 9])  # a completes the tail b still holds
    assert store.bytes_written - before == 7 * TOKEN_BYTES  # assembled: the old 4 + 3 new
    check_invariants(store, {SessionKey("t", "a"): [*ids, 7, 8, 9], SessionKey("t", "b"): ids})
    store.close()


def test_dram_extend_writes_into_the_base_blocks():
    from chatstore.store.tiers.dram import DramTier, TokenKVShape

    tier = DramTier(16 * 4 * TOKEN_BYTES, TokenKVShape(2, 2, 4, torch.float32), block_size=4)
    hasher = ChunkHasher("fp", torch.float32, 16)
    old, new = hasher.chain("t", list(range(6)))[0], hasher.chain("t", list(range(13)))[0]
    tier.put(old, SessionKV(list(range(6)), kv_of(list(range(6)))))
    used = tier.used_bytes()
    rows = list(range(5, 13))  # keeps 5 of the 6 (a divergence at the last one), adds 8
    assert tier.extend(old, new, 5, SessionKV(rows, kv_of(rows, 5)))
    got = tier.get(new)
    assert got.token_ids == list(range(5)) + rows and not tier.contains(old)
    assert torch.equal(got.kv, torch.cat([kv_of(list(range(5))), kv_of(rows, 5)], dim=2))
    assert tier.used_bytes() == used + 2 * 4 * TOKEN_BYTES  # 2 blocks -> 4 blocks
    tier.check_integrity()


def test_shared_prefix_is_stored_once_and_freed_with_its_last_holder(tmp_path):
    store = make(tmp_path)
    system = list(range(1, 17))  # two full chunks
    turn(store, "t", "a", [*system, 50, 51, 52])
    turn(store, "t", "b", [*system, 60, 61])
    turn(store, "other", "c", [*system, 60, 61])  # another tenant: its own chunks
    shared = store.index.get(SessionKey("t", "a")).chunks[:2]
    assert store.index.get(SessionKey("t", "b")).chunks[:2] == shared
    assert all(
        store.index.owners_of(k) == {SessionKey("t", "a"), SessionKey("t", "b")} for k in shared
    )
    assert len(store.tiers.keys()) == 2 + 1 + 1 + 3  # shared prefix once; tails; other tenant
    store.delete_session("t", "a")
    assert all(store.tiers.contains(k) for k in shared)  # b still holds them
    store.delete_session("t", "b")
    assert not any(store.tiers.contains(k) for k in shared)
    check_invariants(store, {SessionKey("other", "c"): [*system, 60, 61]})
    store.close()


def test_restart_deletes_chunks_no_record_lists(tmp_path):
    store = make(tmp_path, dram_bytes=0)
    turn(store, "t", "s", list(range(30)))
    orphan = ChunkHasher("fp", torch.float32, CHUNK).chain("t", [7] * CHUNK)[0]
    store.tier("ssd").put(orphan, SessionKV([7] * CHUNK, kv_of([7] * CHUNK)))  # as a crash leaves
    store.close()
    again = make(tmp_path, dram_bytes=0)
    assert not again.tier("ssd").contains(orphan)
    check_invariants(again, {SessionKey("t", "s"): list(range(30))})
    again.close()


OPS = st.lists(
    st.tuples(
        st.sampled_from(["turn", "turn", "turn", "fork", "delete", "evict", "expire", "restart"]),
        st.integers(0, 3),  # session
        st.integers(0, 3),  # other session (fork source)
        st.integers(1, 20),  # new tokens
    ),
    min_size=1,
    max_size=30,
)


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=OPS, async_save=st.booleans())
def test_random_lifecycles_never_leak_or_lose_a_chunk(tmp_path, ops, async_save):
    path = tmp_path / uuid.uuid4().hex  # not `random`: Hypothesis seeds it per example
    store = make(path, async_save=async_save)
    expected: dict[SessionKey, list[int]] = {}
    rng = random.Random(len(ops))
    system = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]  # every session starts alike: shared chunks
    try:
        for op, s, other, n in ops:
            key = SessionKey("t", f"s{s}")
            if op == "turn":
                ids = expected.get(key, system) + [rng.randrange(2, 500) for _ in range(n)]
                turn(store, "t", key.session_id, ids)
                expected[key] = ids
            elif op == "fork" and SessionKey("t", f"s{other}") in expected:
                source = expected[SessionKey("t", f"s{other}")]
                ids = [*source[: rng.randrange(1, len(source) + 1)], rng.randrange(2, 500)]
                store.delete_session("t", key.session_id)
                turn(store, "t", key.session_id, ids)
                expected[key] = ids
            elif op == "delete":
                store.delete_session("t", key.session_id)
                expected.pop(key, None)
            elif op == "evict" and key in expected:
                push_down(store, "t", key.session_id)
            elif op == "expire" and key in expected:
                store.flush_writes(10)
                record = store.records.get(key)
                record.updated_at -= 10 * 86400
                store.records.put(record)
                assert key in store.purge_expired()
                expected.pop(key)
            elif op == "restart":
                store.close()
                store = make(path, async_save=async_save)
            check_invariants(store, expected)
    finally:
        store.close()


def test_write_back_reaches_ssd_within_the_lag(tmp_path):
    store = make(tmp_path, persist="write_back", persist_lag_s=0.05)
    turn(store, "t", "s", list(range(20)))
    chunks = store.index.get(SessionKey("t", "s")).chunks
    assert store.persister is not None and store.persister.flush(5)
    ssd = store.tier("ssd")
    assert all(ssd.contains(k) for k in chunks)
    assert all(store.tiers.where(k) == "dram" for k in chunks)  # still served from DRAM
    store.close(flush_dram=False)  # as a crash would: nothing more is written
    again = make(tmp_path)
    assert lookup(again, "t", "s").token_ids == list(range(20))
    again.close()


@pytest.mark.parametrize("persist", ["write_through", "off"])
def test_persist_modes(tmp_path, persist):
    store = make(tmp_path, persist=persist)
    turn(store, "t", "s", list(range(20)))
    on_ssd = [store.tier("ssd").contains(k) for k in store.index.get(SessionKey("t", "s")).chunks]
    assert all(on_ssd) if persist == "write_through" else not any(on_ssd)
    store.close()


def test_turns_lookups_and_prefetches_on_threads_keep_the_invariants(tmp_path):
    """Turns that evict (writer thread), lookups and prefetch hints at once: the session policy
    is read by evictions and told about uses from other threads; nothing may break or leak."""
    store = make(tmp_path, async_save=True, dram_bytes=3 * CHUNK * TOKEN_BYTES)
    store.set_waiting_queue(lambda: [SessionKey("t", "s0"), SessionKey("t", "s3")])
    expected = {SessionKey("t", f"s{i}"): list(range(i * 100, i * 100 + 5)) for i in range(6)}
    errors: list[BaseException] = []
    stop = threading.Event()

    def readers() -> None:
        rng = random.Random(1)
        try:
            while not stop.is_set():
                sid = f"s{rng.randrange(6)}"
                store.find("t", sid)
                store.prefetch("t", sid)
                lookup(store, "t", sid)
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=readers)
    thread.start()
    try:
        rng = random.Random(0)
        for _ in range(60):
            key = SessionKey("t", f"s{rng.randrange(6)}")
            expected[key] = expected[key] + [
                rng.randrange(2, 500) for _ in range(rng.randrange(1, 12))
            ]
            turn(store, "t", key.session_id, expected[key])
    finally:
        stop.set()
        thread.join()
    assert not errors, errors
    check_invariants(store, expected)
    store.close()
