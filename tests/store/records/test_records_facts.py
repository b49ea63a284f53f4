"""The session facts the record store keeps for every replica: per-tenant counts (the quota holds
across replicas) and the expiry index (the purge reads only what is due)."""

from __future__ import annotations

import time

import pytest

from chatstore.store.records.lmdb import LmdbRecordStore
from chatstore.store.records.record import RecordConflict, SessionRecord
from chatstore.store.records.redis import RedisRecordStore
from chatstore.store.session_kv import SessionKey


class CountingLmdb(LmdbRecordStore):
    """A real LMDB record store that counts the records it reads."""

    loads = 0

    def _load(self, key):
        self.loads += 1
        return super()._load(key)

    def _load_due(self, tenant, digest):
        self.loads += 1
        return super()._load_due(tenant, digest)


class CountingRedis(RedisRecordStore):
    loads = 0

    def _load(self, key):
        self.loads += 1
        return super()._load(key)

    def _load_due(self, tenant, digest):
        self.loads += 1
        return super()._load_due(tenant, digest)


@pytest.fixture(params=["lmdb", "redis"])
def make(request, tmp_path):
    def factory(ttl_s=0):
        if request.param == "lmdb":
            return CountingLmdb(tmp_path / "records", ttl_s=ttl_s)
        client = request.getfixturevalue("redis_client")
        return CountingRedis(client, ttl_s=ttl_s)

    return factory


def test_counts_follow_create_turn_and_delete(make):
    records = make()
    for i in range(3):
        records.create(SessionRecord("acme", f"s{i}"))
    records.create(SessionRecord("other", "s0"))
    with pytest.raises(RecordConflict):
        records.create(SessionRecord("acme", "s0"))
    records.append_turn(SessionKey("acme", "s1"), 1, [{"role": "user", "content": "hi"}])
    records.upsert(SessionKey("acme", "s2"), token_ids=[1, 2])
    assert records.count_sessions("acme") == 3 and records.count_sessions("other") == 1
    assert records.delete(SessionKey("acme", "s0"))
    assert not records.delete(SessionKey("acme", "s0"))  # counted down once
    assert records.count_sessions("acme") == 2
    records.delete_tenant("acme")
    assert records.count_sessions("acme") == 0 and records.count_sessions("other") == 1


def test_counts_are_shared_by_two_stores_on_one_redis(redis_client):
    a, b = RedisRecordStore(redis_client), RedisRecordStore(redis_client)
    a.create(SessionRecord("acme", "on-a"))
    b.create(SessionRecord("acme", "on-b"))
    assert a.count_sessions("acme") == b.count_sessions("acme") == 2
    b.delete(SessionKey("acme", "on-a"))
    assert a.count_sessions("acme") == 1


def test_a_lapsed_session_leaves_the_count_before_the_purge(make):
    records = make(ttl_s=60)
    records.put(SessionRecord("acme", "old", updated_at=time.time() - 1000))
    records.create(SessionRecord("acme", "new"))
    assert records.count_sessions("acme") == 1


def test_the_purge_reads_only_the_due_records(make):
    records = make(ttl_s=60)
    for i in range(20):
        records.create(SessionRecord("acme", f"live{i}"))
    records.put(SessionRecord("acme", "old", updated_at=time.time() - 1000))
    records.put(SessionRecord("bob", "own-ttl", ttl_s=5, updated_at=time.time() - 10))
    records.put(SessionRecord("bob", "kept", ttl_s=5000, updated_at=time.time() - 1000))
    records.loads = 0
    gone = records.purge_expired()
    assert set(gone) == {SessionKey("acme", "old"), SessionKey("bob", "own-ttl")}
    assert records.loads == 2  # the due ones only: none of the 21 live records was read
    assert records.get(SessionKey("acme", "old")) is None
    assert records.count_sessions("acme") == 20 and records.count_sessions("bob") == 1
    records.loads = 0
    assert records.purge_expired() == [] and records.loads == 0


def test_a_turn_moves_the_deadline(make):
    records = make(ttl_s=60)
    key = SessionKey("acme", "s")
    records.put(SessionRecord("acme", "s", updated_at=time.time() - 50))
    records.upsert(key, token_ids=[1])  # activity: due 60 s from now, not in 10 s
    assert records.purge_expired(now=time.time() + 30) == []
    assert records.purge_expired(now=time.time() + 90) == [key]


def test_lmdb_index_is_rebuilt_when_the_server_ttl_changes(tmp_path):
    records = LmdbRecordStore(tmp_path / "records", ttl_s=0)  # nothing expires
    records.put(SessionRecord("acme", "old", updated_at=time.time() - 1000))
    assert records.purge_expired() == []
    records.close()
    records = CountingLmdb(tmp_path / "records", ttl_s=60)
    assert records.count_sessions("acme") == 0
    assert records.purge_expired() == [SessionKey("acme", "old")]


def test_lmdb_records_written_before_the_facts_are_counted(tmp_path):
    from chatstore.store.records import lmdb_facts

    records = LmdbRecordStore(tmp_path / "records", ttl_s=60)
    for i in range(3):
        records.create(SessionRecord("acme", f"s{i}"))
    with records.env.begin(write=True) as txn:  # as an older version left the store
        lmdb_facts.drop_tenant(txn, "acme")
        txn.delete(lmdb_facts.EXPIRY_TTL)
    records.close()
    records = LmdbRecordStore(tmp_path / "records", ttl_s=60)
    assert records.count_sessions("acme") == 3


def test_the_start_reads_only_the_sessions_it_needs(tmp_path):
    records = LmdbRecordStore(tmp_path / "records", ttl_s=60)
    for i in range(10):
        records.create(SessionRecord("acme", f"plain{i}"))  # no KV, no retention of its own
    records.upsert(SessionKey("acme", "kv"), token_ids=[1, 2], chunks=["c0"])
    records.create(SessionRecord("bob", "kept", priority=5))
    records.upsert(SessionKey("acme", "was-kv"), token_ids=[1], chunks=["c1"])
    records.upsert(SessionKey("acme", "was-kv"), token_ids=[], chunks=[])  # its KV dropped
    records.close()
    records = CountingLmdb(tmp_path / "records", ttl_s=60)
    found = {r.session_id for r in records.restore_sessions()}
    assert found == {"kv", "kept"}
    records.delete(SessionKey("acme", "kv"))
    assert {r.session_id for r in records.restore_sessions()} == {"kept"}


def test_redis_start_reads_only_the_sessions_it_needs(redis_client):
    records = RedisRecordStore(redis_client, ttl_s=60)
    for i in range(5):
        records.create(SessionRecord("acme", f"plain{i}"))
    records.upsert(SessionKey("acme", "kv"), token_ids=[1, 2], chunks=["c0"])
    records.create(SessionRecord("bob", "kept", priority=5))
    other = RedisRecordStore(redis_client, ttl_s=60)  # another replica's start
    assert {r.session_id for r in other.restore_sessions()} == {"kv", "kept"}
    records.upsert(SessionKey("acme", "kv"), token_ids=[], chunks=[])
    assert {r.session_id for r in other.restore_sessions()} == {"kept"}
