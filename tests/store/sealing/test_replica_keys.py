"""Replicas whose keys differ never delete each other's data (issue 33): a value a replica
cannot open is a miss there, counted in open_failures, and stays in Redis.

Real engines (a tiny model), real redis-servers (KV under allkeys-lru, records under
noeviction), real LMDB:

- two replicas with different master keys over one records Redis (so one key store): each
  serves its own tenants with the fresh-run tokens, cannot open the other's chunks (counted),
  and no chunk is deleted from Redis; with key stores of their own, their names never meet;
- a rolling master-key rotation, `k2,k1` on one replica and `k1` on the other, sharing records
  and data keys: both serve a tenant made before it, a tenant made on the rotated replica opens
  nowhere else until that replica has k2 too, and no chunk is deleted;
- a shred on one replica stops the tenant's values opening on the other at its next key check.
"""

from __future__ import annotations

import pytest
import redis as redis_lib

from chatstore.store.sealing.master_key import new_secret_line
from tests.support.engine import prompt
from tests.support.replicas import CHUNK, Replica

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.timeout(300)]

DRAM = 0  # every read of a stored chunk goes to Redis
REDIS_BYTES = 64 << 20


def _deletes(client) -> int:
    """DEL / UNLINK / GETDEL calls the Redis server has answered."""
    stats = client.info("commandstats")
    return sum(
        int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("del", "unlink", "getdel")
    )


def _chunk_names(client) -> set[bytes]:
    return set(client.scan_iter(match="chatstore:kv:*", count=1000))


def test_replicas_with_different_master_keys_delete_no_chunk(tmp_path, kv_redis, records_redis):
    """A replica given another master key by mistake, sharing records and data keys: each
    serves the tenants whose keys it made, cannot open the other's (a miss, counted), and
    deletes nothing."""
    kv = redis_lib.Redis.from_url(kv_redis.url)
    a = Replica(
        tmp_path, "a", kv_redis.url, records_redis.url, new_secret_line(), DRAM, REDIS_BYTES
    )
    b = Replica(
        tmp_path, "b", kv_redis.url, records_redis.url, new_secret_line(), DRAM, REDIS_BYTES
    )
    try:
        history = prompt(3, 3 * CHUNK + 5)
        assert a.turn("ta", "chat", history).cached == 0
        assert b.turn("tb", "chat", history).cached == 0
        assert a.turn("ta", "chat", [*history, *prompt(4, 9)]).cached >= 3 * CHUNK
        assert b.turn("tb", "chat", [*history, *prompt(4, 9)]).cached >= 3 * CHUNK
        written = _chunk_names(kv)
        for reader, writer, tenant in ((b, a, "ta"), (a, b, "tb")):
            chunks = writer.chunks(tenant, "chat")
            assert reader.store.tier("remote").discover(chunks) == len(chunks)
            before = reader.open_failures()
            for chunk in chunks:
                assert reader.store.tiers.get(chunk, promote=False, count=False) is None
            assert reader.open_failures() == before + len(chunks)
        assert _deletes(kv) == 0
        assert written <= _chunk_names(kv)  # every chunk is still in Redis
    finally:
        a.close()
        b.close()


def test_replicas_with_keys_of_their_own_name_the_same_chunks_apart(tmp_path, kv_redis):
    """Each replica its own master key, records and data keys (records_url = lmdb): the same
    conversation's chunks get other names on each (names are keyed per tenant key), so
    neither reads nor overwrites the other's, and nothing is deleted."""
    kv = redis_lib.Redis.from_url(kv_redis.url)
    a = Replica(tmp_path, "a", kv_redis.url, "lmdb", new_secret_line(), DRAM, REDIS_BYTES)
    b = Replica(tmp_path, "b", kv_redis.url, "lmdb", new_secret_line(), DRAM, REDIS_BYTES)
    try:
        history = prompt(3, 3 * CHUNK + 5)
        assert a.turn("t", "chat", history).cached == 0
        assert b.turn("t", "chat", history).cached == 0
        assert not set(a.chunks("t", "chat")) & set(b.chunks("t", "chat"))
        assert a.turn("t", "chat", [*history, *prompt(4, 9)]).cached >= 3 * CHUNK
        assert b.turn("t", "chat", [*history, *prompt(4, 9)]).cached >= 3 * CHUNK
        assert a.open_failures() == b.open_failures() == 0 and _deletes(kv) == 0
    finally:
        a.close()
        b.close()


def test_a_rolling_master_key_rotation_deletes_no_chunk(tmp_path, kv_redis, records_redis):
    """Replicas sharing records and data keys mid-rotation: `k2,k1` on a, `k1` on b."""
    kv = redis_lib.Redis.from_url(kv_redis.url)
    k1, k2 = new_secret_line("k1"), new_secret_line("k2")
    b = Replica(tmp_path, "b", kv_redis.url, records_redis.url, k1, DRAM, REDIS_BYTES)
    history = prompt(6, 2 * CHUNK + 3)
    try:
        assert b.turn("old", "chat", history).cached == 0  # a tenant made before the rotation
        a = Replica(tmp_path, "a", kv_redis.url, records_redis.url, f"{k2},{k1}", DRAM, REDIS_BYTES)
        try:
            # Both serve the tenant made before the rotation, from each other's chunks.
            assert a.turn("old", "chat", [*history, *prompt(7, 5)]).cached >= 2 * CHUNK
            assert (
                b.turn("old", "chat", [*history, *prompt(7, 5), *prompt(8, 5)]).cached >= 2 * CHUNK
            )
            # A tenant made on a now: its data key is wrapped by k2, which b lacks.
            assert a.turn("new", "chat", history).cached == 0
            written = _chunk_names(kv)
            new_chunks = a.chunks("new", "chat")
            before = b.open_failures()
            assert b.store.tier("remote").discover(new_chunks) == len(new_chunks)
            for chunk in new_chunks:
                assert b.store.tiers.get(chunk, promote=False, count=False) is None  # a miss
            assert b.open_failures() == before + len(new_chunks)
            assert _deletes(kv) == 0 and written <= _chunk_names(kv)
            assert a.turn("new", "chat", [*history, *prompt(9, 5)]).cached >= 2 * CHUNK  # a: intact
        finally:
            a.close()
        b.close()
        # b restarted with k2 as well: the rotation is whole, and the chunks open there.
        b = Replica(tmp_path, "b", kv_redis.url, records_redis.url, f"{k2},{k1}", DRAM, REDIS_BYTES)
        b.store.tier("remote").discover(new_chunks)
        for chunk in new_chunks:
            assert b.store.tiers.get(chunk, promote=False, count=False) is not None
        assert b.open_failures() == 0 and _deletes(kv) == 0
    finally:
        b.close()


def test_a_shred_on_one_replica_stops_its_values_opening_on_the_other(
    tmp_path, kv_redis, records_redis
):
    secret = new_secret_line()
    a = Replica(tmp_path, "a", kv_redis.url, records_redis.url, secret, DRAM, REDIS_BYTES)
    b = Replica(tmp_path, "b", kv_redis.url, records_redis.url, secret, DRAM, REDIS_BYTES)
    try:
        history = prompt(11, 2 * CHUNK + 1)
        a.turn("gone", "chat", history)
        chunks = a.chunks("gone", "chat")
        sealed = [
            a.store.tier("remote").client.get(a.store.tier("remote")._name(c)) for c in chunks
        ]
        b.store.tier("remote").discover(chunks)
        assert b.store.tiers.get(chunks[0], promote=False, count=False) is not None  # b: cached
        a.store.shred_tenant("gone")
        # A backup of the values, put back: b still holds the key in its cache until its
        # watcher sees the key store's epoch move (once a second); then they never open.
        remote = b.store.tier("remote")
        for chunk, value in zip(chunks, sealed, strict=True):
            remote.client.set(remote._name(chunk), value)
        assert b.store.key_watch is not None
        b.store.key_watch.poll()
        before = b.open_failures()
        remote.discover(chunks)
        for chunk in chunks:
            assert b.store.tiers.get(chunk, promote=False, count=False) is None
        assert b.open_failures() == before + len(chunks)
    finally:
        a.close()
        b.close()
