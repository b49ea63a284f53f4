"""The device tier of /admin/cache, /metrics and the dashboard is the engine's block pool and
prefix cache, read from the engine's own counters (api cache_tiers.device_tier): after a second
turn whose history came from the device, it shows the bytes, the session and the hits that the
block pool reports, with the KV store on and off."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from chatstore.api.admin.tiers import cache_tiers, device_tier
from chatstore.api.common.settings import ServerSettings
from chatstore.engine.engine_stats import EngineStats
from chatstore.server.launcher import local_server
from chatstore.store.ports import ContextBudget, TierStats, store_hits
from chatstore.store.session_store import SessionStore

SYSTEM = (
    "You are a careful assistant for a small bakery. Answer in one short sentence, name "
    "the bread when you can, and never list more than one item. Prices are in euros."
)
GREEDY = {"temperature": 0, "max_tokens": 5}


def engine_stats(**fields: int) -> EngineStats:
    zeros = {name: 0 for name in EngineStats.__dataclass_fields__}
    return EngineStats(**{**zeros, "mean_batch_size": 0.0, **fields})


def test_the_device_line_is_the_engine_numbers():
    stats = engine_stats(
        num_blocks=100, free_blocks=90, evictable_blocks=30, block_size=16, block_bytes=1000,
        prefix_hits=7, prefix_misses=3, prefix_evictions=2, cached_sessions=4,
    )  # fmt: skip
    assert stats.kv_blocks == 40  # 10 in use + 30 free but still cached
    assert device_tier(stats) == TierStats(
        "device", 100_000, 40_000, 4, hits=7, misses=3, bytes_up=0, bytes_down=0, evictions=2,
        prefetches=0,
    )  # fmt: skip


def test_kv_store_off_still_has_the_device_line_and_no_store_hit_rate():
    stats = engine_stats(num_blocks=10, free_blocks=10, block_bytes=8, prefix_hits=5)
    records_only = SessionStore(object(), context=ContextBudget(2048), leases=object())
    (device,) = cache_tiers(stats, records_only)
    assert (device.name, device.hits, device.capacity_bytes) == ("device", 5, 80)
    assert store_hits([device]) == (0, 0)  # the overall rate is the store tiers'
    dram = TierStats("dram", 1, 1, 1, hits=2, misses=1, bytes_up=0, bytes_down=0, evictions=0,
                     prefetches=0)  # fmt: skip
    assert store_hits([device, dram]) == (2, 1)


def scrape(http: httpx.Client) -> dict[tuple[str, str], float]:
    """(sample name, tier) -> value of the chatstore_store_* series."""
    out = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name.startswith("chatstore_store_") and "tier" in sample.labels:
                out[(sample.name, sample.labels["tier"])] = sample.value
    return out


@pytest.mark.model
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kv_store", ["on", "off"])
def test_a_second_turn_from_the_device_shows_in_the_device_tier(default_model, tmp_path, kv_store):
    settings = ServerSettings(purge_interval_s=0)  # local mode: the one user is the admin
    with local_server(
        tmp_path, default_model, settings, kv_cache_bytes=32 << 20, kv_store=kv_store
    ) as server:
        engine = server.app.state.service.engine.engine  # the LLMEngine under the async one
        with httpx.Client(base_url=server.url, timeout=120) as http:
            sid = http.post("/v1/sessions", json={"system_prompt": SYSTEM}).json()["id"]
            for content in ("Rye?", "Spelt?"):
                body = {"content": content, **GREEDY}
                reply = http.post(f"/v1/sessions/{sid}/messages", json=body)
                assert reply.status_code == 200, reply.text
            from_device = reply.json()["usage"]["cached_tokens_by_tier"]["device"]
            assert from_device > 0  # the client's "history from device"

            cache = http.get("/admin/cache").json()
            metrics = scrape(http)
            pool, blocks = engine.runtime.pool, engine.blocks.stats()

    assert cache["tiers"][0]["name"] == "device"
    tiers = {t["name"]: t for t in cache["tiers"]}
    if kv_store == "off":
        assert list(tiers) == ["device"] and cache["hit_rate"] is None
    device, stats = tiers["device"], cache["engine"]
    # The engine's own numbers, as /admin/cache shows them and as the block pool holds them.
    spec = default_model.spec
    elem = {"float32": 4, "bfloat16": 2, "float16": 2}[stats["dtype"]]
    block_bytes = 2 * spec.num_layers * stats["block_size"] * spec.num_kv_heads * spec.head_dim
    assert stats["block_bytes"] == block_bytes * elem
    kv_blocks = pool.num_used + blocks.evictable_blocks  # in use, or free and still cached
    assert kv_blocks == stats["num_blocks"] - stats["free_blocks"] + stats["evictable_blocks"]
    assert blocks.cached_blocks > 0 and blocks.hit_blocks >= 1
    assert device["used_bytes"] == kv_blocks * stats["block_bytes"] > 0
    assert device["capacity_bytes"] == pool.num_blocks * stats["block_bytes"]
    assert device["sessions"] == stats["cached_sessions"] == blocks.sessions == 1
    assert device["hits"] == stats["prefix_hits"] == blocks.hit_blocks
    assert device["hits"] * stats["block_size"] >= from_device
    assert device["misses"] == stats["prefix_misses"] == blocks.miss_blocks
    assert device["evictions"] == stats["prefix_evictions"] == blocks.evictions
    assert device["hit_rate"] == device["hits"] / (device["hits"] + device["misses"])
    # /metrics exports the same line.
    assert metrics[("chatstore_store_used_bytes", "device")] == device["used_bytes"]
    assert metrics[("chatstore_store_sessions", "device")] == device["sessions"]
    assert metrics[("chatstore_store_hits_total", "device")] == device["hits"]
    assert metrics[("chatstore_store_misses_total", "device")] == device["misses"]
