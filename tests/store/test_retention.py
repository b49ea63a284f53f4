"""Per-session retention (priority, ttl_s): placement order in a real store, expiry, restarts,
records (LMDB and Redis), and PATCH /v1/sessions/{id} over HTTP on a real server."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from chatstore.api.common.settings import ServerSettings
from chatstore.server.launcher import local_server
from chatstore.store.attention_store import AttentionStore
from chatstore.store.records.lmdb import LmdbRecordStore
from chatstore.store.records.record import SessionRecord
from chatstore.store.records.redis import RedisRecordStore
from chatstore.store.retention import Retention
from chatstore.store.session_kv import SessionKey
from chatstore.store.session_store import SessionStore
from chatstore.store.settings import StoreSettings
from tests.support.store import BLOCK, TINY_SPEC, evictions, lookup, value

TENANT = "t"


def key(sid: str) -> SessionKey:
    return SessionKey(TENANT, sid)


def make(tmp_path, policy: str = "lru", dram_sessions: int = 3, **kw) -> AttentionStore:
    settings = StoreSettings(
        data_dir=tmp_path, dram_bytes=dram_sessions * BLOCK, ssd_bytes=1 << 20, policy=policy, **kw
    )
    return AttentionStore(settings, TINY_SPEC, "fp")


def create(adapter: SessionStore, sid: str, priority: int = 0, ttl_s: int = 0) -> None:
    now = time.time()
    record = SessionRecord(TENANT, sid, [], [], {}, now, now, priority=priority, ttl_s=ttl_s)
    assert adapter.create(record)


# -- placement in a real store ------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "fifo", "aware"])
def test_full_dram_keeps_the_high_priority_idle_session(tmp_path, policy):
    store = make(tmp_path, policy)
    adapter = SessionStore(store.records, store)
    evicted = evictions(store)
    dram = store.tier("dram")
    assert dram is not None
    create(adapter, "a", priority=5)  # the oldest and idlest: first to go without priority
    for i, sid in enumerate("abc"):
        store.save(TENANT, sid, value(16, i))
    for i, sid in enumerate("de"):
        store.save(TENANT, sid, value(16, 10 + i))
        assert dram.used_bytes() <= dram.capacity
    assert evicted == [key("b"), key("c")]  # lower priority moved down, in the policy's order
    assert [store.tier_of(TENANT, s) for s in "abcde"] == ["dram", "ssd", "ssd", "dram", "dram"]
    # Everything left in DRAM is high priority: a new session still gets its room.
    for sid in "de":
        assert adapter.update(TENANT, sid, priority=5) is not None
    store.save(TENANT, "f", value(16, 20))
    assert dram.used_bytes() <= dram.capacity
    assert evicted == [key("b"), key("c"), key("a")]  # the oldest of the priority-5 class
    store.close()


def test_per_session_ttl_purges_that_session_only(tmp_path):
    store = make(tmp_path, session_ttl_s=3600)
    adapter = SessionStore(store.records, store)
    create(adapter, "short", ttl_s=1)
    create(adapter, "long")
    store.save(TENANT, "short", value(16, 1))
    store.save(TENANT, "long", value(16, 2))
    got = adapter.get(TENANT, "short")
    assert got is not None and got.ttl_s == 1
    assert got.expires_at == pytest.approx(got.updated_at + 1)
    long = adapter.get(TENANT, "long")
    assert long is not None and long.expires_at == pytest.approx(long.updated_at + 3600)
    time.sleep(1.2)
    assert store.find(TENANT, "short") is None  # expired reads as absent before the purge
    assert adapter.get(TENANT, "short") is None
    assert adapter.purge_expired() == 1
    assert (
        store.index.get(key("short")) is None and store.retention.get(key("short")) == Retention()
    )
    assert store.records._load(key("short")) is None
    assert lookup(store, TENANT, "long") is not None and adapter.get(TENANT, "long") is not None
    store.close()


def test_restart_keeps_retention_and_the_policy_learns_it(tmp_path):
    store = make(tmp_path)
    adapter = SessionStore(store.records, store)
    create(adapter, "a", priority=7, ttl_s=3600)
    create(adapter, "b")
    store.save(TENANT, "a", value(16, 1))
    store.save(TENANT, "b", value(16, 2))
    assert adapter.update(TENANT, "b", priority=-3) is not None
    store.close()
    again = make(tmp_path)
    adapter = SessionStore(again.records, again)
    a = adapter.get(TENANT, "a")
    assert a is not None and (a.priority, a.ttl_s) == (7, 3600)
    assert again.retention.get(key("a")) == Retention(7, 3600)
    policy = again.session_policy.policy
    assert (policy.priority(key("a")), policy.priority(key("b"))) == (7, -3)
    # After a restart no session has been touched: priority still decides who goes first.
    assert again.session_policy.rank("dram", [key("a"), key("b")]) == [key("b"), key("a")]
    again.close()


# -- records --------------------------------------------------------------------------------


def test_records_written_before_retention_load_with_defaults(tmp_path):
    old = {"tenant": TENANT, "session_id": "old", "messages": [], "version": 3}
    record = SessionRecord.from_json(json.dumps(old))
    assert (record.priority, record.ttl_s, record.version) == (0, 0, 3)
    records = LmdbRecordStore(tmp_path / "records.lmdb", ttl_s=60)
    records.put(record)
    assert records.patch(key("missing"), priority=1) is None
    patched = records.patch(key("old"), priority=4, ttl_s=10)
    assert patched is not None and (patched.priority, patched.ttl_s, patched.version) == (4, 10, 3)
    assert records.expires_at(patched) == pytest.approx(record.updated_at + 10)
    records.close()


def test_redis_record_expiry_follows_the_session_ttl(redis_client):
    records = RedisRecordStore(redis_client, ttl_s=0)
    records.create(SessionRecord(TENANT, "r", ttl_s=50))
    records.create(SessionRecord(TENANT, "forever"))
    name = records._name(key("r"))
    assert 45 <= redis_client.ttl(name) <= 50
    assert redis_client.ttl(records._name(key("forever"))) == -1  # no server TTL: no expiry
    patched = records.patch(key("r"), ttl_s=500, priority=2)
    assert patched is not None and patched.version == 1
    assert 490 <= redis_client.ttl(name) <= 500
    assert records.patch(key("nope"), priority=1) is None


# -- over HTTP ------------------------------------------------------------------------------

ALICE, BOB, ADMIN = "key-alice", "key-bob", "key-admin"


def auth(k: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {k}"}


def serve(default_model, data_dir):
    settings = ServerSettings(
        api_keys={ALICE: "alice", BOB: "bob"}, admin_key=ADMIN, purge_interval_s=0
    )
    return local_server(
        data_dir, default_model, settings, kv_cache_bytes=32 << 20, dram_bytes=64 << 20
    )


@pytest.mark.model
@pytest.mark.timeout(300)
def test_retention_over_http_survives_a_restart(default_model, tmp_path):
    with serve(default_model, tmp_path) as server:
        alice = httpx.Client(base_url=server.url, headers=auth(ALICE), timeout=120)
        bob = httpx.Client(base_url=server.url, headers=auth(BOB), timeout=120)
        admin = httpx.Client(base_url=server.url, headers=auth(ADMIN), timeout=120)
        store = server.app.state.service.store.kv
        made = alice.post("/v1/sessions", json={"id": "s1", "priority": 3, "ttl_s": 7200})
        assert made.status_code == 201, made.text
        body = made.json()
        assert (body["priority"], body["ttl_s"]) == (3, 7200)
        assert body["expires_at"] == pytest.approx(body["updated_at"] + 7200)
        turn = alice.post("/v1/sessions/s1/messages", json={"content": "Hi.", "max_tokens": 4})
        assert turn.status_code == 200, turn.text
        policy = store.session_policy.policy
        assert policy.priority(SessionKey("alice", "s1")) == 3

        patched = alice.patch("/v1/sessions/s1", json={"priority": -2, "metadata": {"k": "v"}})
        assert patched.status_code == 200, patched.text
        p = patched.json()
        assert (p["priority"], p["ttl_s"], p["metadata"], p["num_messages"]) == (
            -2,
            7200,
            {"k": "v"},
            2,
        )
        assert policy.priority(SessionKey("alice", "s1")) == -2  # placement knows at once
        listed = alice.get("/v1/sessions").json()["data"]
        assert [(s["id"], s["priority"], s["ttl_s"]) for s in listed] == [("s1", -2, 7200)]

        # Refusals: unknown or another tenant's session, bad values, nothing to change.
        assert alice.patch("/v1/sessions/nope", json={"priority": 1}).status_code == 404
        assert bob.patch("/v1/sessions/s1", json={"priority": 1}).status_code == 404
        for bad, param in (
            ({"priority": 11}, "priority"),
            ({"priority": "high"}, "priority"),
            ({"ttl_s": -1}, "ttl_s"),
            ({"colour": "red"}, "colour"),
        ):
            r = alice.patch("/v1/sessions/s1", json=bad)
            assert r.status_code == 400, (bad, r.text)
            assert r.json()["error"]["param"] == param and r.json()["error"]["message"]
        assert alice.patch("/v1/sessions/s1", json={}).status_code == 400
        assert alice.post("/v1/sessions", json={"priority": -11}).status_code == 400

        # The admin views: the session list and the per-session cache table.
        rows = admin.get("/admin/sessions").json()["data"]
        assert [(r["id"], r["tenant"], r["priority"]) for r in rows] == [("s1", "alice", -2)]
        cache = admin.get("/admin/cache").json()["sessions"]
        assert cache["total"] == 1
        row = cache["data"][0]
        assert (row["id"], row["tenant"], row["priority"], row["ttl_s"]) == (
            "s1",
            "alice",
            -2,
            7200,
        )
        assert row["expires_at"] == pytest.approx(row["updated_at"] + 7200)
        assert row["kv_tiers"] == ["dram"] and row["kv_location"] == "dram"
        assert row["kv_tokens"] == alice.get("/v1/sessions/s1").json()["num_tokens"]
        assert row["kv_bytes"] == row["kv_tokens"] * store.layout.bytes_per_token
        assert row["kv_bytes_by_tier"] == {"dram": row["kv_bytes"]}
        paged = admin.get("/admin/cache/sessions", params={"tenant": "bob"}).json()
        assert paged["data"] == [] and paged["total"] == 0

        # A short per-session TTL: the purge takes that session only.
        alice.post("/v1/sessions", json={"id": "brief", "ttl_s": 1})
        time.sleep(1.2)
        assert server.app.state.service.purge_expired() == 1
        assert alice.get("/v1/sessions/brief").status_code == 404
        assert alice.get("/v1/sessions/s1").status_code == 200
    with serve(default_model, tmp_path) as server:
        alice = httpx.Client(base_url=server.url, headers=auth(ALICE), timeout=120)
        again = alice.get("/v1/sessions/s1").json()
        assert (again["priority"], again["ttl_s"], again["metadata"]) == (-2, 7200, {"k": "v"})
        store = server.app.state.service.store.kv
        assert store.session_policy.policy.priority(SessionKey("alice", "s1")) == -2
