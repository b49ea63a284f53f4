"""End to end with the real default model: history restored from each tier gives the same greedy
tokens as recomputing it, and only the new tokens are prefilled.

No engine here: tests/support/multiturn.py's MiniEngine drives ModelRunner.forward with
ForwardBatch the way the engine does (num_external_tokens -> load -> prefill with the connector
as kv_sink -> decode -> request_finished), so the store is tested against the runner alone.
"""

from __future__ import annotations

import pytest
import redis as redis_lib

from chatstore.store.attention_store import AttentionStore
from chatstore.store.settings import StoreSettings
from chatstore.transfer import StoreConnector
from tests.support.multiturn import CHUNK, MiniEngine, make_store
from tests.support.store import saved_tokens

pytestmark = [pytest.mark.model, pytest.mark.slow]


@pytest.mark.parametrize("tier", ["dram", "lmdb", "redis", "restart"])
def test_history_restored_from_tier_gives_identical_tokens(
    default_model, reference, tier, tmp_path, request
):
    url = request.getfixturevalue("redis_url") if tier == "redis" else ""
    if url:
        redis_lib.Redis.from_url(url).flushall()
    engine = MiniEngine(default_model)
    store = make_store(default_model, tmp_path, tier, url)
    tier_name = {"dram": "dram", "lmdb": "ssd", "restart": "ssd", "redis": "remote"}[tier]
    for i, ref in enumerate(reference):
        if tier == "restart" and i > 0:
            store.close()  # nothing in memory survives: a new store over the same data dir
            store = make_store(default_model, tmp_path, tier)
            chain = store.index.get(store.key("acme", "s1"))
            assert set(store.tier("ssd").keys()) == set(chain.chunks)
        engine.attach(StoreConnector(store, engine.cache, engine.runner.rope))
        got = engine.turn(ref.prompt)
        assert got.output == ref.output, f"turn {i + 1} differs when restored from {tier}"
        if i == 0:
            assert got.cached == 0
        else:
            prev = reference[i - 1]
            # Everything up to the previous reply's re-rendering is reused.
            assert got.cached >= len(prev.prompt) + len(prev.output) - 2
            assert store.stats().counters.tier(tier_name).hits > 0
        assert store.tier_of("acme", "s1") == tier_name
    saved = saved_tokens(store, "acme", "s1")
    assert saved == (reference[-1].prompt + reference[-1].output)[: len(saved)]
    store.close()


def test_history_split_between_device_and_store_gives_identical_tokens(
    default_model, reference, tmp_path
):
    """The device holds the first tokens (8, then 40: not chunk boundaries): the store loads
    only the chunks past them (the third turn skips chunk 0), and the answer is the
    recompute's."""
    engine = MiniEngine(default_model)
    store = make_store(default_model, tmp_path, "dram")
    engine.attach(StoreConnector(store, engine.cache, engine.runner.rope))
    for i, ref in enumerate(reference):
        device = [0, 8, 40][i]
        hits = store.stats().counters.tier("dram").hits
        got = engine.turn(ref.prompt, on_device=device)
        assert got.output == ref.output, f"turn {i + 1} differs"
        if i:
            read = store.stats().counters.tier("dram").hits - hits
            assert got.cached > device
            assert read == -(-got.cached // CHUNK) - device // CHUNK  # chunks past the device
    store.close()


def test_corrupted_lmdb_value_is_a_miss_and_recomputed(default_model, reference, tmp_path):
    engine = MiniEngine(default_model)
    store = make_store(default_model, tmp_path, "lmdb")
    engine.attach(StoreConnector(store, engine.cache, engine.runner.rope))
    engine.turn(reference[0].prompt)
    ssd = store.tier("ssd")
    first = store.index.get(store.key("acme", "s1")).chunks[0]
    chunk = bytearray(ssd.raw_value(first))
    chunk[len(chunk) // 2] ^= 0x01  # one flipped bit in the middle of the KV
    ssd.write_raw_value(first, bytes(chunk))
    got = engine.turn(reference[1].prompt)
    assert got.cached == 0 and got.output == reference[1].output
    assert store.stats().counters.tier("ssd").corrupt == 1
    store.close()


def test_another_models_store_is_not_reused(default_model, reference, tmp_path):
    engine = MiniEngine(default_model)
    store = make_store(default_model, tmp_path, "lmdb")
    engine.attach(StoreConnector(store, engine.cache, engine.runner.rope))
    engine.turn(reference[0].prompt)
    store.close()
    other = AttentionStore(
        StoreSettings(data_dir=tmp_path, dram_bytes=0, ssd_bytes=256 << 20),
        default_model.spec,
        "another-model-fingerprint",
    )
    engine.attach(StoreConnector(other, engine.cache, engine.runner.rope))
    got = engine.turn(reference[1].prompt)
    assert got.cached == 0 and got.output == reference[1].output
    other.close()
