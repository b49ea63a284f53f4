"""The AttentionStore as the server uses it: records, lifecycle, model change, restart, config."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import redis as redis_lib
import torch

from chatstore.config import load_config
from chatstore.engine.kv_connector import NullConnector
from chatstore.store.attention_store import create_store
from chatstore.store.records.lmdb import LmdbRecordStore
from chatstore.store.records.record import SessionRecord
from chatstore.store.records.redis import RedisRecordStore
from chatstore.store.session_kv import SessionKey
from chatstore.transfer import create_connector
from tests.support.store import TINY_SPEC, TOKEN_BYTES, lookup, make, saved_tokens, value


@pytest.fixture(params=["lmdb", "redis"])
def records(request, tmp_path):
    if request.param == "lmdb":
        store = LmdbRecordStore(tmp_path / "records.lmdb", ttl_s=100)
    else:
        client = redis_lib.Redis.from_url(request.getfixturevalue("redis_url"))
        client.flushall()
        store = RedisRecordStore(client, ttl_s=100)
    yield store
    store.close()


def test_records_upsert_get_list_delete(records):
    key = SessionKey("acme", "s1")
    messages = [{"role": "user", "content": "hi"}]
    first = records.upsert(key, messages=messages, token_ids=[1, 2, 3])
    got = records.get(key)
    assert got.messages == messages and got.token_ids == [1, 2, 3]
    assert got.created_at == first.created_at
    records.upsert(SessionKey("other", "s2"))
    assert [r.session_id for r in records.list_sessions("acme")] == ["s1"]
    assert records.delete(key) and records.get(key) is None


def test_records_expire_after_ttl(records):
    old = SessionRecord("acme", "old", updated_at=time.time() - 1000)
    records.put(old)
    records.upsert(SessionKey("acme", "new"))
    assert records.get(old.key) is None
    assert records.purge_expired() == [old.key]
    assert [r.session_id for r in records.list_sessions()] == ["new"]


def test_save_lookup_and_record(tmp_path):
    store = make(tmp_path)
    assert store.save("acme", "s1", value(20)) == "dram"
    assert lookup(store, "acme", "s1").equal(value(20))
    assert saved_tokens(store, "acme", "s1") == value(20).token_ids
    assert lookup(store, "acme", "nope") is None and lookup(store, "other", "s1") is None
    store.close()


def test_delete_removes_kv_from_every_tier_and_the_record(tmp_path, redis_url):
    redis_lib.Redis.from_url(redis_url).flushall()
    store = make(tmp_path, dram_bytes=2 * 16 * TOKEN_BYTES, ssd_bytes=3000, redis_url=redis_url)
    for i in range(4):
        store.save("acme", f"s{i}", value(16, seed=i))
    tiers = {store.tier_of("acme", f"s{i}") for i in range(4)}
    assert tiers == {"dram", "ssd", "remote"}
    for i in range(4):
        assert store.delete_session("acme", f"s{i}")
        assert lookup(store, "acme", f"s{i}") is None
        assert store.records.get(store.key("acme", f"s{i}")) is None
    assert all(t.used_bytes() == 0 for t in store.tiers.tiers)
    store.close(flush_dram=False)


def test_expired_session_is_forgotten(tmp_path):
    store = make(tmp_path, session_ttl_s=1)
    store.save("acme", "s1", value(8))
    time.sleep(1.1)
    assert lookup(store, "acme", "s1") is None  # reads as absent at once
    assert store.purge_expired() == [store.key("acme", "s1")]  # the purge timer frees it
    assert store.tier_of("acme", "s1") is None
    assert store.tiers.keys() == set()
    store.close()


def test_model_change_invalidates_everything(tmp_path):
    store = make(tmp_path, dram_bytes=0)
    store.save("acme", "s1", value(8))
    store.close()
    other = make(tmp_path, fingerprint="another-model", dram_bytes=0)
    assert lookup(other, "acme", "s1") is None
    assert other.tier("ssd").used_bytes() == 0
    other.close()


def test_graceful_close_keeps_dram_sessions_on_disk(tmp_path):
    store = make(tmp_path)
    store.save("acme", "s1", value(8))
    assert store.tier_of("acme", "s1") == "dram"
    store.close()
    again = make(tmp_path)
    assert lookup(again, "acme", "s1").equal(value(8))
    again.close()


def test_two_data_dirs_share_nothing(tmp_path):
    a, b = make(tmp_path / "a", dram_bytes=0), make(tmp_path / "b", dram_bytes=0)
    a.save("acme", "s1", value(8))
    assert lookup(b, "acme", "s1") is None and saved_tokens(b, "acme", "s1") == []
    a.close()
    b.close()


def test_kill_9_loses_no_acknowledged_record_or_kv(tmp_path):
    root = Path(__file__).resolve().parents[2]
    child = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {str(root)!r})
        from tests.support.store import make, value
        from pathlib import Path
        store = make(Path({str(tmp_path)!r}), dram_bytes=0)
        store.save("acme", "s1", value(12, seed=3))
        store.records.upsert(store.key("acme", "s1"), messages=[{{"role": "user", "content": "x"}}])
        print("acknowledged", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, cwd=root)
    assert "acknowledged" in out.stdout and out.returncode == -9, out.stderr
    store = make(tmp_path, dram_bytes=0)
    assert lookup(store, "acme", "s1").equal(value(12, seed=3))
    assert store.records.get(store.key("acme", "s1")).messages[0]["content"] == "x"
    store.close()


def test_fit_context_cuts_prompt_and_saved_kv(tmp_path):
    store = make(
        tmp_path, max_context_tokens=40, truncation_ratio=0.5, block_size=4, chunk_tokens=4
    )
    history = value(30)
    store.save("acme", "s1", history)
    prompt = [*history.token_ids, 7, 8, 9, 10, 11]  # 35 tokens: fits
    assert store.fit_context("acme", "s1", prompt, head=4, tail=5) == prompt
    prompt = history.token_ids + list(range(500, 515))  # 45 > 40: drop 20 after the head
    cut = store.fit_context("acme", "s1", prompt, head=4, tail=15)
    assert cut == prompt[:4] + prompt[24:]
    saved = lookup(store, "acme", "s1")
    assert saved.token_ids == history.token_ids[:4] + history.token_ids[24:]
    assert torch.equal(saved.kv[:, :, 4:], history.kv[:, :, 24:])
    store.close()


def test_half_precision_storage_halves_the_bytes(tmp_path):
    full, half = make(tmp_path / "a"), make(tmp_path / "b", storage_dtype=torch.float16)
    full.save("t", "s", value(32))
    half.save("t", "s", value(32))
    assert half.tier("dram").used_bytes() * 2 == full.tier("dram").used_bytes()
    assert lookup(half, "t", "s").dtype == torch.float16
    full.close()
    half.close()


def test_config_switches_and_data_dir(tmp_path):
    off = load_config(env={"CHATSTORE_KV_STORE": "off"})
    assert create_store(off, TINY_SPEC, "fp") is None
    assert isinstance(create_connector(None, None, None), NullConnector)
    on = load_config(env={"CHATSTORE_DATA_DIR": str(tmp_path / "d"), "CHATSTORE_DRAM_BYTES": "0"})
    store = create_store(on, TINY_SPEC, "fp")
    assert store.settings.data_dir == tmp_path / "d"
    assert (tmp_path / "d" / "kv.lmdb").is_dir() and (tmp_path / "d" / "records.lmdb").is_dir()
    assert [t.name for t in store.tiers.tiers] == ["ssd"]
    store.close()
    with pytest.raises(ValueError):
        load_config(env={"CHATSTORE_KV_STORE": "maybe"})


def test_session_metadata_survives_reopen(tmp_path) -> None:
    from chatstore.store.records.lmdb import LmdbRecordStore
    from chatstore.store.records.record import SessionRecord
    from chatstore.store.session_kv import SessionKey

    key = SessionKey("t1", "s1")
    records = LmdbRecordStore(tmp_path / "records.lmdb")
    records.upsert(
        key, metadata={"title": "trip plans"}, messages=[{"role": "user", "content": "hi"}]
    )
    records.close()
    reopened = LmdbRecordStore(tmp_path / "records.lmdb")
    got = reopened.get(key)
    assert got is not None and got.metadata == {"title": "trip plans"}
    # Records written before the field existed still load.
    legacy = b'{"tenant": "t", "session_id": "s", "messages": [], "token_ids": [1]}'
    assert SessionRecord.from_json(legacy).metadata == {}
    reopened.close()
