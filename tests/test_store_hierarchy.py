"""The tier hierarchy: exact demotion order, promotion on use, capacity under a random workload."""

from __future__ import annotations

import random

import pytest
import redis as redis_lib
import torch

from chatstore.store.dram_tier import DramTier, KVLayout
from chatstore.store.hierarchy import TierHierarchy
from chatstore.store.lmdb_tier import LmdbTier, encoded_footprint
from chatstore.store.redis_tier import RedisTier
from chatstore.store.session_kv import SessionKey, SessionKV

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)
BLOCK = 4
BLOCK_BYTES = LAYOUT.bytes_per_token * BLOCK  # 512


def value(num_tokens: int, seed: int = 0) -> SessionKV:
    g = torch.Generator().manual_seed(seed)
    return SessionKV(list(range(num_tokens)), torch.randn((2, 2, num_tokens, 2, 4), generator=g))


def K(name: str) -> SessionKey:
    return SessionKey("t", name)


@pytest.fixture
def two_tiers(tmp_path):
    # DRAM: 4 blocks = two sessions of 8 tokens; SSD: two encoded sessions of 8 tokens.
    dram = DramTier(4 * BLOCK_BYTES, LAYOUT, BLOCK)
    ssd = LmdbTier(tmp_path / "kv.lmdb", 2 * encoded_footprint(value(8)), "fp", chunk_bytes=300)
    yield TierHierarchy([dram, ssd])
    ssd.close()


def test_lru_session_moves_down_then_falls_off(two_tiers):
    h = two_tiers
    for name in "abcd":
        h.put(K(name), value(8, seed=ord(name)))
    assert [h.tier_of(K(n)) for n in "abcd"] == ["ssd", "ssd", "dram", "dram"]
    h.put(K("e"), value(8, seed=ord("e")))  # c -> ssd, a (oldest on ssd) dropped
    assert [h.tier_of(K(n)) for n in "abcde"] == [None, "ssd", "ssd", "dram", "dram"]
    c = h.counters
    assert c.tier("dram").evictions == 3 and c.tier("ssd").evictions == 1 and c.dropped == 1
    assert c.bytes_down == 3 * value(8).nbytes
    h.check_capacity()


def test_use_promotes_to_dram_and_pushes_lru_down(two_tiers):
    h = two_tiers
    for name in "abc":
        h.put(K(name), value(8, seed=ord(name)))
    assert h.tier_of(K("a")) == "ssd"
    got = h.get(K("a"))
    assert got.equal(value(8, seed=ord("a")))
    assert h.tier_of(K("a")) == "dram" and h.tier_of(K("b")) == "ssd"
    assert h.counters.tier("ssd").hits == 1 and h.counters.bytes_up == got.nbytes
    h.get(K("a"))
    assert h.counters.tier("dram").hits == 1
    assert h.get(K("zz")) is None and h.counters.misses == 1
    kinds = [e.kind for e in h.events.recent]
    assert kinds.count("promoted") == 1 and kinds[-1] == "miss"


def test_prefetch_moves_up_without_a_hit(two_tiers):
    h = two_tiers
    for name in "abc":
        h.put(K(name), value(8, seed=ord(name)))
    assert h.prefetch(K("a")) and h.tier_of(K("a")) == "dram"
    assert h.counters.prefetches == 1 and h.counters.tier("ssd").hits == 0
    assert not h.prefetch(K("a"))  # already at the top


def test_value_bigger_than_dram_goes_straight_to_ssd(two_tiers):
    h = two_tiers
    assert h.put(K("big"), value(17)) == "ssd"  # 5 blocks > 4
    assert h.get(K("big")).equal(value(17))
    assert h.tier_of(K("big")) == "ssd"  # cannot be promoted either


def test_corrupt_value_is_a_miss_and_gone(two_tiers):
    h = two_tiers
    for name in "abc":
        h.put(K(name), value(8, seed=ord(name)))
    ssd = h.tiers[1]
    chunk = bytearray(ssd.raw_chunk(K("a"), 1))
    chunk[5] ^= 0x40
    ssd.write_raw_chunk(K("a"), 1, bytes(chunk))
    assert h.get(K("a")) is None
    assert h.counters.tier("ssd").corrupt == 1 and h.counters.misses == 1
    assert h.tier_of(K("a")) is None


def test_delete_removes_from_every_tier(two_tiers):
    h = two_tiers
    for name in "abc":
        h.put(K(name), value(8, seed=ord(name)))
    assert h.delete(K("a")) and h.delete(K("c"))
    assert h.tier_of(K("a")) is None and h.tier_of(K("c")) is None
    assert not h.delete(K("a"))


def test_demote_all_flushes_dram(two_tiers):
    h = two_tiers
    h.put(K("a"), value(8))
    h.demote_all(0)
    assert h.tier_of(K("a")) == "ssd" and h.tiers[0].used_bytes() == 0


def test_stats_report_occupancy_and_counters(two_tiers):
    h = two_tiers
    h.put(K("a"), value(8))
    h.get(K("a"))
    stats = h.stats().as_dict()
    assert [t["name"] for t in stats["tiers"]] == ["dram", "ssd"]
    assert stats["tiers"][0]["used_bytes"] == 2 * BLOCK_BYTES
    assert stats["tiers"][0]["sessions"] == 1 and stats["tiers"][0]["hits"] == 1


def test_random_workload_never_exceeds_capacity(tmp_path, redis_server):
    client = redis_lib.Redis.from_url(redis_server.url)
    client.flushall()
    rng = random.Random(0)
    dram = DramTier(12 * BLOCK_BYTES, LAYOUT, BLOCK)
    ssd = LmdbTier(tmp_path / "kv.lmdb", 6000, "fp", chunk_bytes=512)
    remote = RedisTier(client, 5000, "fp", ttl_s=60, chunk_bytes=512)
    h = TierHierarchy([dram, ssd, remote])
    truth: dict[SessionKey, SessionKV] = {}
    for step in range(300):
        key = K(str(rng.randrange(25)))
        op = rng.random()
        if op < 0.5:
            v = value(rng.randrange(1, 30), seed=step)
            if h.put(key, v) is not None:
                truth[key] = v
            else:
                truth.pop(key, None)
        elif op < 0.9:
            got = h.get(key)
            if got is not None:
                assert got.equal(truth[key])  # never a wrong value
        else:
            h.delete(key)
            truth.pop(key, None)
        h.check_capacity()
        dram.check_integrity()
        held = {k for t in h.tiers for k in t.keys()}  # noqa: SIM118
        assert held <= set(truth)  # nothing held that was deleted or replaced
        for k in held:
            assert sum(t.contains(k) for t in h.tiers) == 1  # exactly one tier
        truth = {k: v for k, v in truth.items() if k in held}
    assert h.counters.tier("dram").evictions > 0 and h.counters.dropped > 0
    ssd.close()
    client.close()
