"""Redis Cluster as the shared KV tier and the records store, against real `redis-server`s:
chunks spread over the masters, records per tenant, a whole AttentionStore, a slot moved
mid-run (ASK, then MOVED), a master killed and restarted, a replica taking over."""

from __future__ import annotations

import time

import pytest
import redis as redis_lib
from redis.cluster import RedisCluster

from chatstore.store.records.record import SessionRecord
from chatstore.store.records.redis import RedisRecordStore
from chatstore.store.session_kv import SessionKey
from chatstore.store.tiers.base import TierUnavailable
from chatstore.store.tiers.breaker import CircuitBreaker
from chatstore.store.tiers.redis import RedisTier
from chatstore.store.tiers.redis_client import cluster_startup_nodes, connect_redis
from tests.support.redis_faults import redis_sends
from tests.support.redis_server import redis_server_binary, start_local_redis_cluster
from tests.support.store import TOKEN_BYTES, lookup, make, value
from tests.support.tier_values import K
from tests.support.tier_values import value as chunk

pytestmark = pytest.mark.skipif(redis_server_binary() is None, reason="needs redis-server")


@pytest.fixture(scope="module")
def cluster():
    server = start_local_redis_cluster(masters=3)
    yield server
    server.stop()


@pytest.fixture
def client(cluster):
    """A cluster client on an emptied cluster."""
    out = connect_redis(cluster.url, 1.0)
    out.flushall(target_nodes=RedisCluster.PRIMARIES)
    yield out
    out.close()


def keys_per_master(cluster) -> dict[int, int]:
    return {p: redis_lib.Redis(port=p).dbsize() for p in cluster.master_ports()}


def test_cluster_urls_pick_the_cluster_client(cluster, redis_url):
    assert cluster_startup_nodes("redis+cluster://u:p@h1:7000,h2/0") == (
        [("h1", 7000), ("h2", 6379)],
        {"ssl": False, "username": "u", "password": "p"},
    )
    first = cluster.url.split("://")[1].split(",")[0]
    for c in (connect_redis(cluster.url, 1.0), connect_redis(f"redis://{first}", 1.0, True)):
        assert isinstance(c, RedisCluster) and len(c.get_primaries()) == 3
        c.close()
    assert type(connect_redis(redis_url, 1.0)) is redis_lib.Redis


def test_chunks_spread_over_masters_and_survive_a_restart_of_the_index(client, cluster):
    tier = RedisTier(client, 1 << 24, "fp", ttl_s=60)
    keys = [K(f"c{i}", tenant=f"t{i % 3}") for i in range(60)]
    tier.put_many([(k, chunk(4, seed=i)) for i, k in enumerate(keys)])  # one pipeline, 3 nodes
    spread = keys_per_master(cluster)
    assert sum(spread.values()) == 60 and sum(n > 0 for n in spread.values()) > 1
    got = tier.get_many(keys)
    assert all(g.equal(chunk(4, seed=i)) for i, g in enumerate(got))
    # A restarted process starts knowing nothing (no SCAN) and learns by one pipelined
    # round split over the masters.
    again = RedisTier(client, 1 << 24, "fp")
    assert again.keys() == [] and again.discover(keys) == 60
    assert sorted(again.keys(), key=str) == sorted(keys, key=str)
    # delete forgets (Redis keeps a shared chunk); delete_shared removes it.
    assert tier.delete(keys[0]) and tier.get(keys[0]) is not None
    assert tier.delete_shared(keys[0]) and tier.get(keys[0]) is None
    # A shared flush walks every master.
    assert tier.clear_shared("t1") == 20 and sum(keys_per_master(cluster).values()) == 39
    assert tier.health().state == "closed"


def test_records_per_tenant_on_a_cluster(client):
    records = RedisRecordStore(client, ttl_s=100)
    odd = "a*b{c}:d"  # glob and hash-tag characters in a tenant stay literal
    for tenant in ("acme", odd, "other"):
        for i in range(5):
            records.upsert(SessionKey(tenant, f"s{i}"), token_ids=[i])
    assert records.get(SessionKey(odd, "s3")).token_ids == [3]
    assert sorted(r.session_id for r in records.list_sessions(odd)) == [f"s{i}" for i in range(5)]
    assert {r.tenant for r in records.list_sessions("acme")} == {"acme"}
    assert len(records.list_sessions()) == 15
    # Unrelated names that share the record's tag are not records.
    first = SessionKey("acme", "s0")
    client.set(records._name(first) + ":lease", b"x")
    assert len(records.list_sessions("acme")) == 5
    assert records.delete(first) and records.get(first) is None


def test_legacy_record_names_are_renamed_once(redis_client):
    old = SessionRecord("acme", "s1", token_ids=[1, 2])
    both = SessionRecord("acme", "s2", token_ids=[3])
    store = RedisRecordStore(redis_client, ttl_s=0)
    for record in (old, both):
        legacy = store._name(record.key).replace("{", "").replace("}", "")
        redis_client.set(legacy, record.to_json())
    store.put(SessionRecord("acme", "s2", token_ids=[4]))  # the tagged one is newer
    redis_client.delete(RedisRecordStore.FACTS_BUILT)  # as a Redis an older version wrote
    store = RedisRecordStore(redis_client, ttl_s=0)
    assert store.get(old.key).token_ids == [1, 2] and store.get(both.key).token_ids == [4]
    records = sorted(n.decode() for n in redis_client.keys(f"{RedisRecordStore.PREFIX}*"))
    assert records == sorted(store._name(r.key) for r in (old, both))
    assert store.count_sessions("acme") == 2  # counted once, the renamed one included
    assert redis_client.exists(RedisRecordStore.FACTS_BUILT)  # the next start scans nothing


@pytest.mark.parametrize("how", ["scheme", "flag"])
def test_attention_store_over_a_cluster(tmp_path, client, cluster, how):
    url = cluster.url if how == "scheme" else "redis://" + cluster.url.split("://")[1].split(",")[0]
    store = make(
        tmp_path,
        dram_bytes=2 * 16 * TOKEN_BYTES,
        ssd_bytes=3000,
        redis_url=url,
        redis_cluster=how == "flag",
    )
    for i in range(6):
        store.save("acme", f"s{i}", value(16, seed=i))
    assert "remote" in {store.tier_of("acme", f"s{i}") for i in range(6)}
    for i in range(6):
        assert lookup(store, "acme", f"s{i}").equal(value(16, seed=i))
    assert len(store.records.list_sessions("acme")) == 6
    assert sum(keys_per_master(cluster).values()) > 6  # chunks and records in the cluster
    for i in range(6):
        assert store.delete_session("acme", f"s{i}")
    assert store.records.list_sessions() == []
    store.close(flush_dram=False)


def migrate_slot(client, name: str, finish: bool) -> None:
    """Move the slot of `name` (with its keys) to another master, by hand as redis-cli does;
    with finish=False the slot is left half-moved (reads get ASK)."""
    slot = client.keyslot(name)
    source = client.get_node_from_key(name)
    target = next(n for n in client.get_primaries() if n.name != source.name)
    src = redis_lib.Redis(host=source.host, port=source.port)
    dst = redis_lib.Redis(host=target.host, port=target.port)
    src_id, dst_id = (r.execute_command("CLUSTER", "MYID").decode() for r in (src, dst))
    dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    names = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
    assert name.encode() in names
    src.execute_command("MIGRATE", target.host, target.port, "", 0, 5000, "KEYS", *names)
    if finish:
        for node in client.get_primaries():
            r = redis_lib.Redis(host=node.host, port=node.port)
            r.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)


def test_a_slot_moved_mid_run_is_followed(client):
    tier = RedisTier(client, 1 << 24, "fp", ttl_s=60)
    a, b = K("moved-a"), K("moved-b")
    tier.put_many([(a, chunk(4, seed=1)), (b, chunk(4, seed=2))])
    migrate_slot(client, tier._name(a), finish=False)
    assert tier.get(a).equal(chunk(4, seed=1))  # ASK: the key is on the importing node
    migrate_slot(client, tier._name(b), finish=True)
    assert tier.get(b).equal(chunk(4, seed=2))  # MOVED: the client patches its slot table
    assert tier.health().state == "closed"


def test_a_killed_master_fails_fast_then_recovers(client, cluster, monkeypatch):
    breaker = CircuitBreaker(failures=2, reset_s=0.5)
    tier = RedisTier(connect_redis(cluster.url, 0.25), 1 << 24, "fp", ttl_s=60, breaker=breaker)
    key = K("doomed")
    tier.put(key, chunk(4))
    node = tier.client.get_node_from_key(tier._name(key))
    cluster.kill(node.port)
    try:
        for _ in range(4):
            start = time.monotonic()
            with pytest.raises(TierUnavailable):
                tier.get(key)
            # A liveness bound (a hang would end here, not at the test's timeout); that the
            # client stops retrying is the breaker's open state below, not a speed.
            assert time.monotonic() - start < 15.0
        assert breaker.is_open() and not tier.contains(key)
        with (
            redis_sends(monkeypatch) as sends,
            pytest.raises(TierUnavailable, match="circuit open"),
        ):
            tier.get(key)
        assert not sends, f"an open circuit still sent {sends}"
    finally:
        cluster.spawn(node.port)  # same nodes.conf: same node id, same slots
        cluster.wait_ok()
    deadline = time.monotonic() + 10
    while True:
        try:
            assert tier.get(key) is None  # back, but empty: nothing was persisted
            break
        except TierUnavailable:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    tier.put(K("after"), chunk(4, seed=3))
    assert tier.get(K("after")).equal(chunk(4, seed=3))


def test_a_replica_takes_over_a_killed_master():
    cluster = start_local_redis_cluster(masters=3, replicas=1)
    try:
        breaker = CircuitBreaker(failures=3, reset_s=0.2)
        tier = RedisTier(connect_redis(cluster.url, 0.5), 1 << 24, "fp", ttl_s=60, breaker=breaker)
        key = K("kept")
        tier.put(key, chunk(4, seed=7))
        master = tier.client.get_node_from_key(tier._name(key))
        redis_lib.Redis(port=master.port).execute_command("WAIT", 1, 2000)  # replicated
        cluster.kill(master.port)
        deadline = time.monotonic() + 15
        while True:  # misses while the replica waits out the node timeout, then its data
            try:
                got = tier.get(key)
                if got is not None:
                    break
            except TierUnavailable:
                pass
            assert time.monotonic() < deadline, "the replica never took over"
            time.sleep(0.2)
        assert got.equal(chunk(4, seed=7))
        assert master.port not in cluster.master_ports()
    finally:
        cluster.stop()


def test_throughput_sanity(client, capsys):
    tier = RedisTier(client, 1 << 28, "fp", ttl_s=60)
    items = [(K(f"bulk{i}"), chunk(64, seed=i)) for i in range(400)]
    start = time.monotonic()
    for i in range(0, len(items), 50):
        tier.put_many(items[i : i + 50])
    wrote = time.monotonic() - start
    start = time.monotonic()
    for i in range(0, len(items), 50):
        assert all(v is not None for v in tier.get_many([k for k, _ in items[i : i + 50]]))
    read = time.monotonic() - start
    with capsys.disabled():
        print(f"\ncluster: 400 chunks written in {wrote:.3f}s, read in {read:.3f}s")
