"""Each tier on its own: put/get/delete/contains/keys, byte capacity, corruption, restart."""

from __future__ import annotations

import os
import random
import stat
import threading
import time
from collections import deque

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from chatstore.store.tiers import codec
from chatstore.store.tiers.base import TierFull, encoded_footprint
from chatstore.store.tiers.dram import DramTier, TokenKVShape
from chatstore.store.tiers.lmdb import LmdbTier
from chatstore.store.tiers.redis import RedisTier
from tests.support.tier_values import K, value

LAYOUT = TokenKVShape(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)
BLOCK = 4  # tokens per DRAM block
BLOCK_BYTES = LAYOUT.bytes_per_token * BLOCK  # 2 * 2 * 2 * 4 * 4 B * 4 tokens = 512


def make_tier(kind: str, capacity: int, path, client=None, fingerprint: str = "fp"):
    if kind == "dram":
        return DramTier(capacity, LAYOUT, BLOCK)
    if kind == "lmdb":
        return LmdbTier(path, capacity, fingerprint)
    return RedisTier(client, capacity, fingerprint, ttl_s=60)


@pytest.fixture(params=["dram", "lmdb", "redis"])
def tier_factory(request, tmp_path):
    client = request.getfixturevalue("redis_client") if request.param == "redis" else None
    made = []

    def factory(capacity: int):
        tier = make_tier(request.param, capacity, tmp_path / f"kv{len(made)}.lmdb", client)
        made.append(tier)
        return tier

    yield factory
    for tier in made:
        if request.param == "lmdb":
            tier.close()


def test_put_get_delete_round_trip(tier_factory):
    tier = tier_factory(64 * BLOCK_BYTES)
    a, b = K("a"), K("b")
    tier.put(a, value(7, seed=1))
    tier.put(b, value(3, seed=2))
    assert tier.get(a).equal(value(7, seed=1))
    assert tier.get(b).equal(value(3, seed=2))
    assert tier.contains(a) and sorted(tier.keys(), key=str) == [a, b]
    assert tier.used_bytes() == tier.size_of(a) + tier.size_of(b) > 0
    assert tier.delete(a) and not tier.contains(a)
    if isinstance(tier, RedisTier):  # shared: delete forgets it here, Redis keeps it
        assert tier.get(a).equal(value(7, seed=1)) and tier.contains(a)
        assert tier.delete_shared(a) and not tier.contains(a)
    assert tier.get(a) is None
    assert not tier.delete(a)
    assert tier.used_bytes() == tier.size_of(b) == tier.footprint(value(3, seed=2))


def test_capacity_is_never_exceeded(tier_factory):
    if isinstance(tier_factory(1), RedisTier):
        pytest.skip("the shared tier has no budget here: test_redis_put_never_refuses_for_budget")
    one = value(8)
    probe = tier_factory(1 << 20)
    capacity = 3 * probe.footprint(one)
    tier = tier_factory(capacity)
    for i in range(3):
        tier.put(K(str(i)), value(8, seed=i))
    with pytest.raises(TierFull):
        tier.put(K("overflow"), value(8, seed=9))
    assert tier.used_bytes() <= tier.capacity
    assert not tier.contains(K("overflow"))
    tier.put(K("0"), value(8, seed=0))  # a chunk already there: no room needed
    assert tier.get(K("0")).equal(value(8, seed=0))


def test_dram_counts_whole_blocks():
    tier = DramTier(10 * BLOCK_BYTES, LAYOUT, BLOCK)
    assert tier.capacity == 10 * BLOCK_BYTES
    tier.put(K("a"), value(5))  # 2 blocks
    tier.put(K("b"), value(4))  # 1 block
    assert tier.used_bytes() == 3 * BLOCK_BYTES
    tier.check_integrity()
    tier.delete(K("a"))
    assert tier.used_bytes() == BLOCK_BYTES
    tier.check_integrity()


def test_dram_stores_in_its_dtype():
    layout = TokenKVShape(2, 2, 4, torch.bfloat16)
    tier = DramTier(8 * layout.bytes_per_token * BLOCK, layout, BLOCK)
    tier.put(K("a"), value(6))
    got = tier.get(K("a"))
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.kv, value(6).kv.to(torch.bfloat16))
    assert tier.used_bytes() == 2 * BLOCK_BYTES // 2


def test_lmdb_warm_restart_finds_sessions(tmp_path):
    tier = LmdbTier(tmp_path / "kv.lmdb", 1 << 20, "fp")
    tier.put(K("a"), value(6, seed=4))
    used = tier.used_bytes()
    tier.close()
    again = LmdbTier(tmp_path / "kv.lmdb", 1 << 20, "fp")
    assert again.keys() == [K("a")]
    assert again.used_bytes() == used
    assert again.get(K("a")).equal(value(6, seed=4))
    again.close()


def test_lmdb_of_another_model_is_emptied_at_open(tmp_path):
    tier = LmdbTier(tmp_path / "kv.lmdb", 1 << 20, "model-a")
    tier.put(K("a"), value(6))
    tier.close()
    other = LmdbTier(tmp_path / "kv.lmdb", 1 << 20, "model-b")
    assert other.keys() == [] and other.used_bytes() == 0
    assert other.get(K("a")) is None
    other.close()


def test_lmdb_flipped_byte_is_detected_and_dropped(tmp_path):
    tier = LmdbTier(tmp_path / "kv.lmdb", 1 << 20, "fp")
    key = K("a")
    tier.put(key, value(6))
    chunk = bytearray(tier.raw_value(key))
    chunk[len(chunk) - 17] ^= 0xFF  # a byte of the KV
    tier.write_raw_value(key, bytes(chunk))
    with pytest.raises(codec.CorruptValueError):
        tier.get(key)
    assert not tier.contains(key) and tier.used_bytes() == 0
    tier.close()


def test_lmdb_files_are_private_whatever_the_umask(tmp_path):
    path = tmp_path / "kv.lmdb"
    path.mkdir(mode=0o755)  # left by an older version
    umask = os.umask(0o022)
    try:
        tier = LmdbTier(path, 1 << 20, "fp")
        tier.put(K("a"), value(4))
    finally:
        os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    files = list(path.iterdir())
    assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    tier.close()


def test_lmdb_reader_drops_a_vanished_value_only_if_no_writer_put_it_back(tmp_path):
    tier = LmdbTier(tmp_path / "kv.lmdb", 1 << 20, "fp")
    key, gone = K("a"), K("b")
    for k in (key, gone):
        tier.put(k, value(6))
    good = tier.raw_value(key)
    with tier.env.begin(write=True) as txn:  # both values vanish under a reader
        for k in (key, gone):
            txn.delete(k.digest.encode(), db=tier._chunks)
    got = []
    with tier._write_lock:  # a writer is putting `key` back meanwhile
        reader = threading.Thread(target=lambda: got.append(tier.get(key)))
        reader.start()
        reader.join(0.2)
        assert reader.is_alive()  # the reader's drop waits for the writer...
        with tier.env.begin(write=True) as txn:
            txn.put(key.digest.encode(), good, db=tier._chunks)
    reader.join(5)
    assert got == [None]  # ...then looks again and keeps what the writer put
    assert tier.contains(key) and tier.get(key).equal(value(6))
    assert tier.get(gone) is None and not tier.contains(gone)  # still gone: dropped
    assert tier.used_bytes() == tier.footprint(value(6))
    tier.close()


def test_lmdb_footprint_counts_encoded_bytes(tmp_path):
    tier = LmdbTier(tmp_path / "kv.lmdb", 1 << 20, "fp")
    v = value(10)
    assert len(codec.encode(v, "fp")) <= encoded_footprint(v) == tier.footprint(v)
    tier.close()


def test_redis_keys_are_namespaced_by_fingerprint_and_tenant(redis_client):
    a = RedisTier(redis_client, 1 << 20, "model-a", ttl_s=60)
    b = RedisTier(redis_client, 1 << 20, "model-b", ttl_s=60)
    a.put(K("s1", "acme"), value(4))
    assert b.get(K("s1", "acme")) is None and b.keys() == []
    names = [n.decode() for n in redis_client.keys("*")]
    assert names and all(n.startswith("chatstore:kv:model-a:acme:") for n in names)
    assert all(0 < redis_client.ttl(n) <= 60 for n in names)
    # A second process with the same model reads what the first wrote, though it starts
    # knowing nothing (no SCAN at start): a read or a discover teaches it.
    other = RedisTier(redis_client, 1 << 20, "model-a")
    assert other.keys() == [] and other.stored_keys() == [K("s1", "acme")]  # SCAN: jobs only
    assert other.discover([K("s1", "acme"), K("s2", "acme")]) == 1
    assert other.keys() == [K("s1", "acme")]


def _commands(client) -> dict[str, int]:
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(s["calls"]) for name, s in stats.items()}


def test_redis_start_costs_no_round_trip_per_key(redis_client):
    writer = RedisTier(redis_client, 1 << 20, "fp", ttl_s=60)
    writer.put_many([(K(str(i)), value(4, seed=i)) for i in range(20)])
    redis_client.config_resetstat()
    RedisTier(redis_client, 1 << 20, "fp", ttl_s=60)
    calls = _commands(redis_client)
    assert not {"scan", "strlen", "keys", "get"} & set(calls), calls


def test_redis_put_never_refuses_for_budget(redis_client):
    """redis_bytes is a planning number: Redis's maxmemory policy evicts, not this replica."""
    one = value(8)
    tier = RedisTier(redis_client, 2 * encoded_footprint(one), "fp", ttl_s=60)
    for i in range(5):
        tier.put(K(str(i)), value(8, seed=i))
    assert all(tier.get(K(str(i))).equal(value(8, seed=i)) for i in range(5))
    assert tier.used_bytes() > tier.capacity


def test_redis_read_and_put_refresh_the_ttl(redis_client):
    tier = RedisTier(redis_client, 1 << 20, "fp", ttl_s=100)
    a, b = K("a"), K("b")
    tier.put_many([(a, value(4, seed=1)), (b, value(4, seed=2))])
    for key in (a, b):
        redis_client.expire(tier._name(key), 5)
    assert tier.get(a).equal(value(4, seed=1))  # GETEX: the read refreshes it
    assert redis_client.ttl(tier._name(a)) > 90
    tier.put(b, value(4, seed=2))  # a known chunk: EXPIRE, no rewrite
    assert redis_client.ttl(tier._name(b)) > 90
    redis_client.delete(tier._name(b))  # evicted by Redis meanwhile: the put writes it back
    tier.put(b, value(4, seed=2))
    assert tier.get(b).equal(value(4, seed=2))
    assert tier.refresh([a, K("never")]) == 1 and not tier.contains(K("never"))


def test_redis_evicted_chunk_is_a_miss_and_forgotten(redis_client):
    tier = RedisTier(redis_client, 1 << 20, "fp", ttl_s=60)
    tier.put(K("a"), value(4))
    redis_client.delete(tier._name(K("a")))  # as maxmemory's LRU would
    assert tier.contains(K("a"))  # still believed there, until read
    assert tier.get(K("a")) is None and not tier.contains(K("a"))


def test_redis_clear_shared_scoped_to_model_and_tenant(redis_client):
    a = RedisTier(redis_client, 1 << 20, "model-a", ttl_s=60)
    b = RedisTier(redis_client, 1 << 20, "model-b", ttl_s=60)
    a.put_many([(K("1", "acme"), value(4)), (K("2", "beta"), value(4))])
    b.put(K("1", "acme"), value(4))
    assert a.clear_shared("acme") == 1
    assert a.get(K("1", "acme")) is None and a.get(K("2", "beta")) is not None
    assert a.clear_shared() == 1 and a.get(K("2", "beta")) is None
    assert b.get(K("1", "acme")) is not None  # another model's chunks stay


def test_redis_expired_value_is_a_miss(redis_client):
    tier = RedisTier(redis_client, 1 << 20, "fp", ttl_s=1)
    tier.put(K("a"), value(4))
    time.sleep(1.2)
    assert tier.get(K("a")) is None
    assert tier.used_bytes() == 0


def test_redis_flipped_byte_is_detected_and_left_to_redis(redis_client):
    tier = RedisTier(redis_client, 1 << 20, "fp", ttl_s=60)
    key = K("a")
    tier.put(key, value(4))
    name = tier._name(key)
    assert name.endswith("{" + key.digest + "}")  # one Redis Cluster slot per chunk
    chunk = bytearray(redis_client.get(name))
    chunk[len(chunk) - 3] ^= 1
    redis_client.set(name, bytes(chunk))
    with pytest.raises(codec.CorruptValueError):
        tier.get(key)
    assert not tier.contains(key)  # forgotten here, never served
    assert redis_client.get(name) == bytes(chunk)  # no replica deletes on a read (issue 33)


class _ElementsWritten(TorchDispatchMode):
    """Counts the tensor elements torch ops write (new results and in-place targets; views and
    uninitialised allocations write nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        schema = func._schema
        is_view = not schema.is_mutable and any(r.alias_info for r in schema.returns)
        if not is_view and "empty" not in schema.name:
            outs = out if isinstance(out, (tuple, list)) else [out]
            self.elements += sum(o.numel() for o in outs if isinstance(o, torch.Tensor))
        return out


@pytest.mark.parametrize("scatter", [False, True])
def test_dram_get_copies_each_element_once(scatter):
    """get() builds its [L, 2, T, H, D] answer with one copy of the value (it used to gather,
    reshape and make contiguous: three copies), from consecutive or scattered blocks, and the
    answer is its own memory, not a view of the pool."""
    tier = DramTier(64 * BLOCK_BYTES, LAYOUT, BLOCK)
    if scatter:  # blocks handed out in no order, as after many puts and deletes
        tier._free = deque(random.Random(0).sample(list(tier._free), len(tier._free)))
    for num_tokens in (0, 1, 3, 4, 9, 37):
        key, v = K(str(num_tokens)), value(num_tokens, seed=num_tokens)
        tier.put(key, v)
        with _ElementsWritten() as counter:
            got = tier.get(key)
        assert got.equal(v) and got.kv.is_contiguous()
        assert counter.elements == v.kv.numel()
        if num_tokens:
            pool = tier.pool.untyped_storage().data_ptr()
            assert got.kv.untyped_storage().data_ptr() != pool
    tier.check_integrity()


def test_redis_refusing_a_write_for_memory_is_tier_full():
    """A Redis at its maxmemory with noeviction (a misconfigured KV Redis) answers OOM: the
    write is not taken (TierFull: the hierarchy writes elsewhere), the breaker stays closed."""
    from tests.support.redis_server import redis_server_binary, start_local_redis

    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed")
    server = start_local_redis(maxmemory=1024, policy="noeviction")  # far below its own use
    try:
        tier = RedisTier(server.url, 1 << 20, "fp", ttl_s=60)
        with pytest.raises(TierFull, match="maxmemory"):
            tier.put(K("a"), value(64))
        assert not tier.contains(K("a")) and tier.health().state == "closed"
        tier.close()
    finally:
        server.stop()
