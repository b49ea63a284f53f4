"""Session records written by several replicas: a turn appends its messages only on top of the
version it read (compare-and-set), creating a session is create-if-absent, and the store's KV
bookkeeping (token ids, chunks) does not move the version. LMDB and a real Redis alike."""

from __future__ import annotations

import threading
import time

import pytest

from chatstore.api.common.errors import store_error
from chatstore.store.records.lmdb import LmdbRecordStore
from chatstore.store.records.record import RecordConflict, SessionRecord
from chatstore.store.records.redis import RedisRecordStore
from chatstore.store.session_kv import SessionKey

KEY = SessionKey("t", "s")


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def reply(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def test_create_is_create_if_absent(records):
    first = records.create(SessionRecord("t", "s", [user("sys")]))
    assert first.version == 1
    with pytest.raises(RecordConflict):
        records.create(SessionRecord("t", "s", [user("other")]))
    assert records.get(KEY).messages == [user("sys")]


def test_append_turn_appends_and_bumps_the_version(records):
    records.create(SessionRecord("t", "s", [user("sys")]))
    saved = records.append_turn(KEY, 1, [user("a"), reply("A")])
    assert saved.version == 2
    saved = records.append_turn(KEY, 2, [user("b"), reply("B")])
    assert saved.version == 3
    stored = records.get(KEY)
    assert stored.messages == [user("sys"), user("a"), reply("A"), user("b"), reply("B")]
    assert stored.version == 3


def test_two_writers_on_one_base_one_appends_the_other_conflicts(records):
    records.create(SessionRecord("t", "s"))
    records.append_turn(KEY, 1, [user("a"), reply("A")])
    with pytest.raises(RecordConflict):
        records.append_turn(KEY, 1, [user("b"), reply("B")])  # read version 1, as the first
    assert records.get(KEY).messages == [user("a"), reply("A")]


def test_concurrent_writers_exactly_one_wins(records):
    records.create(SessionRecord("t", "s"))
    start = threading.Barrier(8)
    won: list[int] = []
    lost: list[int] = []

    def write(i: int) -> None:
        start.wait()
        try:
            records.append_turn(KEY, 1, [user(f"u{i}"), reply(f"r{i}")])
            won.append(i)
        except RecordConflict:
            lost.append(i)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(lost) == 7
    i = won[0]
    assert records.get(KEY).messages == [user(f"u{i}"), reply(f"r{i}")]


def test_absent_record_is_version_zero(records):
    saved = records.append_turn(KEY, 0, [user("a"), reply("A")])
    assert saved.version == 1 and saved.messages == [user("a"), reply("A")]
    with pytest.raises(RecordConflict):
        records.append_turn(SessionKey("t", "other"), 3, [user("x")])
    assert records.get(SessionKey("t", "other")) is None


def test_kv_bookkeeping_keeps_the_version_and_message_writes_bump_it(records):
    records.create(SessionRecord("t", "s", [user("sys")]))
    records.upsert(KEY, token_ids=[1, 2, 3], chunks=["c"], fingerprint="fp")
    assert records.get(KEY).version == 1  # the turn's own KV commit lands before its save
    saved = records.append_turn(KEY, 1, [user("a")])
    assert saved.token_ids == [1, 2, 3] and saved.version == 2
    records.upsert(KEY, messages=[user("replaced")])
    assert records.get(KEY).version == 3


def test_keep_replaces_an_edited_history(records):
    records.create(SessionRecord("t", "s", [user("a"), reply("A")]))
    saved = records.append_turn(KEY, 1, [user("edited"), reply("E")], keep=0)
    assert saved.messages == [user("edited"), reply("E")] and saved.version == 2


def test_expired_record_reads_as_absent_for_create_and_append(tmp_path):
    records = LmdbRecordStore(tmp_path / "records.lmdb", ttl_s=1)
    old = SessionRecord("t", "s", [user("old")], version=5)
    old.updated_at = time.time() - 10
    records.put(old)
    assert records.create(SessionRecord("t", "s", [user("new")])).version == 6
    records.put(old)
    saved = records.append_turn(KEY, 0, [user("a")])
    assert saved.messages == [user("a")] and saved.version == 1
    records.close()


def test_records_without_a_version_read_as_version_zero():
    raw = b'{"tenant": "t", "session_id": "s", "messages": [], "token_ids_b64": ""}'
    assert SessionRecord.from_json(raw).version == 0
    assert SessionRecord.from_json(SessionRecord("t", "s", version=4).to_json()).version == 4


def test_conflict_is_a_409_session_conflict():
    err = store_error(RecordConflict("session s is at version 3, not 2"))
    assert err.status == 409 and err.code == "session_conflict"
    assert "another replica" in err.message


def test_cas_and_leases_on_a_redis_cluster():
    """Both are single-key operations (a WATCH transaction, Lua on one key): a cluster runs
    them on the session's master."""
    from chatstore.store.records.leases import RedisLeases
    from chatstore.store.tiers.redis import connect_redis
    from tests.support.redis_server import redis_server_binary, start_local_redis_cluster

    if redis_server_binary() is None:
        pytest.skip("needs redis-server")
    cluster = start_local_redis_cluster(masters=3)
    try:
        records = RedisRecordStore(connect_redis(cluster.url, 1.0))
        records.create(SessionRecord("t", "s", [user("sys")]))
        records.append_turn(KEY, 1, [user("a")])
        with pytest.raises(RecordConflict):
            records.append_turn(KEY, 1, [user("b")])
        assert records.get(KEY).messages == [user("sys"), user("a")]
        leases = RedisLeases(records, 1.0)
        lease = leases.acquire(KEY)
        assert lease is not None and leases.acquire(KEY) is None
        leases.release(lease)
        assert leases.acquire(KEY) is not None
        leases.close()
        records.close()
    finally:
        cluster.stop()
