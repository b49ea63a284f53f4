"""The shared tier has one owner of eviction, Redis (issue 23 item 1).

Two replicas (two AttentionStores, each with its tiny engine) share a KV Redis that runs as
deploy/redis-kv.conf says (allkeys-lru, here at a small maxmemory) and keep their session
records in a Redis of their own (noeviction, as deploy/redis-records.conf). Under load Redis
evicts chunks; no acknowledged turn is lost, and a turn on a session whose chunks went
recomputes the same greedy tokens as a fresh run. No replica deletes a chunk the other still
references: the KV Redis receives no DEL/UNLINK when a replica deletes a session or flushes
its own tiers. Real redis-servers (tests/support/redis_server.py), real engines.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import redis as redis_lib

from chatstore.config import Config
from chatstore.store.attention_store import AttentionStore
from chatstore.store.records.redis import RedisRecordStore
from chatstore.store.sealing.master_key import new_secret_line
from chatstore.store.session_kv import ChunkKey, SessionKey
from chatstore.store.settings import StoreSettings
from tests.support.engine import prompt, tiny_runtime
from tests.support.replicas import CHUNK, Replica

pytestmark = pytest.mark.usefixtures("single_thread")

KV_MAXMEMORY = 8 << 20  # the kv_redis fixture's maxmemory here
TENANT = "t"
DRAM = 4 * CHUNK * 512  # a few chunks: the rest lives in Redis only
REDIS_BYTES = 1 << 20  # below what the replicas write: not a budget any more


def _replica(tmp_path, name: str, kv_url: str, records_url: str, secret: str) -> Replica:
    return Replica(tmp_path, name, kv_url, records_url, secret, DRAM, REDIS_BYTES)


def _in_redis(replica: Replica, keys: list[ChunkKey]) -> list[bool]:
    tier = replica.store.tier("remote")
    client = tier.client
    return [bool(client.exists(tier._name(k))) for k in keys]


def _deletes(client) -> int:
    stats = client.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("del", "unlink"))


def test_kv_redis_at_maxmemory_evicts_and_loses_no_acknowledged_turn(
    tmp_path, kv_redis, records_redis
):
    secret = new_secret_line()
    a = _replica(tmp_path, "a", kv_redis.url, records_redis.url, secret)
    b = _replica(tmp_path, "b", kv_redis.url, records_redis.url, secret)
    kv = redis_lib.Redis.from_url(kv_redis.url)
    try:
        history = prompt(7, 3 * CHUNK + 5)
        out, _ = a.turn(TENANT, "chat", history)
        chat_chunks = a.chunks(TENANT, "chat")
        assert all(_in_redis(a, chat_chunks))
        acked = a.load(TENANT, "a", 24, 8 * CHUNK, seed=100) + b.load(
            TENANT, "b", 24, 8 * CHUNK, seed=200
        )
        # Redis evicted (its policy, at its maxmemory); its LRU is sampled, so more load
        # until the chat's first chunk went too.
        for round_ in range(10):
            if not _in_redis(a, chat_chunks)[0]:
                break
            acked += b.load(TENANT, f"c{round_}-", 8, 8 * CHUNK, seed=300 + 10 * round_)
        assert not _in_redis(a, chat_chunks)[0]
        assert int(kv.info("stats")["evicted_keys"]) > 0
        assert int(kv.info("memory")["used_memory"]) <= KV_MAXMEMORY * 1.1
        # No acknowledged turn's record lost: they live in a Redis that never evicts.
        assert isinstance(b.store.records, RedisRecordStore)  # records_url's, not the KV's
        assert b.store.records.client is not b.store.tier("remote").client
        for key in [*acked, SessionKey(TENANT, "chat")]:
            record = b.store.records.get(key)  # either replica's records: the same
            assert record is not None and record.chunks, f"{key}: record lost"
        # The next turn, on the other replica: its chunks are gone, a miss each, recomputed,
        # the same greedy tokens as a fresh run (Replica.turn checks).
        _, cached = b.turn(TENANT, "chat", [*history, *out, *prompt(8, 9)])
        assert cached == 0
        # Both replicas' other sessions read as hits where Redis still has them, misses
        # where it does not: never an error.
        for replica, key in ((a, acked[0]), (b, acked[-1])):
            for chunk in replica.chunks(TENANT, key.session_id):
                value = replica.store.tiers.get(chunk, promote=False, count=False)
                assert value is None or value.num_tokens == CHUNK
    finally:
        a.close()
        b.close()


def test_a_replica_deleting_its_session_keeps_chunks_the_other_references(
    tmp_path, kv_redis, records_redis
):
    secret = new_secret_line()
    a = _replica(tmp_path, "a", kv_redis.url, records_redis.url, secret)
    b = _replica(tmp_path, "b", kv_redis.url, records_redis.url, secret)
    kv = redis_lib.Redis.from_url(kv_redis.url)
    try:
        system = prompt(3, 2 * CHUNK)  # a shared system prompt: the same chunks in both
        a.turn(TENANT, "sa", [*system, *prompt(4, 10)])
        sb = [*system, *prompt(5, 10)]
        out, _ = b.turn(TENANT, "sb", sb)
        shared = sorted(set(a.chunks(TENANT, "sa")) & set(b.chunks(TENANT, "sb")), key=str)
        assert len(shared) == 2 and all(_in_redis(b, shared))
        kv.config_resetstat()
        assert a.store.delete_session(TENANT, "sa")
        a.store.invalidate_all()  # this replica's tiers only
        referenced = set(b.chunks(TENANT, "sb"))
        cross_replica_deletes = sum(not ok for ok in _in_redis(b, sorted(referenced, key=str)))
        assert cross_replica_deletes == 0 and _deletes(kv) == 0
        # A third replica continues B's session from Redis: every chunk is still there.
        c = _replica(tmp_path, "c", kv_redis.url, records_redis.url, secret)
        try:
            _, cached = c.turn(TENANT, "sb", [*sb, *out, *prompt(6, 10)])
        finally:
            c.close()
        assert cached >= 2 * CHUNK  # the shared system prompt, and the rest of B's turn
        # An explicit shared flush does empty the shared tier (every replica recomputes).
        a.store.invalidate_all(shared=True)
        assert not any(_in_redis(b, shared))
    finally:
        a.close()
        b.close()


def test_records_in_an_evicting_redis_are_warned_about(tmp_path, kv_redis, caplog):
    settings = StoreSettings(
        data_dir=tmp_path, dram_bytes=1 << 20, ssd_bytes=0, redis_url=kv_redis.url,
        block_size=4, chunk_tokens=CHUNK, persist="off", encrypt_at_rest=False,
    )  # fmt: skip
    runtime = tiny_runtime()
    with caplog.at_level(logging.WARNING, logger="chatstore.store.store_parts"):
        store = AttentionStore(settings, runtime.model.spec, runtime.model.fingerprint)
    assert "maxmemory-policy is allkeys-lru" in caplog.text
    assert isinstance(store.records, RedisRecordStore)  # records_url "": as before
    store.close()
    caplog.clear()
    lmdb = dataclasses.replace(settings, records_url="lmdb", data_dir=tmp_path / "2")
    with caplog.at_level(logging.WARNING, logger="chatstore.store.store_parts"):
        store = AttentionStore(lmdb, runtime.model.spec, runtime.model.fingerprint)
    assert "maxmemory-policy" not in caplog.text
    assert not isinstance(store.records, RedisRecordStore)
    store.close()


def test_records_url_is_validated():
    assert Config(records_url="lmdb").validate().records_url == "lmdb"
    assert Config(records_url="rediss://h:6379/1").validate().records_url == "rediss://h:6379/1"
    with pytest.raises(ValueError, match="records_url"):
        Config(records_url="postgres://h/db").validate()
