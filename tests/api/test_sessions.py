"""The session API, auth and tenant isolation, admin and metrics, over httpx against a real
server (real default model, engine and store) with two tenants and an admin key."""

from __future__ import annotations

import itertools
import json
import time

import httpx
import pytest

from chatstore.api.common.settings import ServerSettings
from chatstore.server.launcher import local_server
from tests.support.store import push_down

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

ALICE, BOB, ADMIN = "key-alice", "key-bob", "key-admin"
GREEDY = {"temperature": 0, "max_tokens": 6}
CONTEXT = 512


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def server(default_model, tmp_path_factory):
    settings = ServerSettings(
        api_keys={ALICE: "alice", BOB: "bob"}, admin_key=ADMIN, max_message_chars=4000
    )
    data = tmp_path_factory.mktemp("api-sessions")
    srv = local_server(
        data,
        default_model,
        settings,
        kv_cache_bytes=48 << 20,
        dram_bytes=256 << 20,
        max_context_tokens=CONTEXT,  # small, so a few long turns overflow it
    )
    with srv:
        yield srv


@pytest.fixture(scope="module")
def alice(server):
    with httpx.Client(base_url=server.url, headers=auth(ALICE), timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def bob(server):
    with httpx.Client(base_url=server.url, headers=auth(BOB), timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def admin(server):
    with httpx.Client(base_url=server.url, headers=auth(ADMIN), timeout=120) as c:
        yield c


def sse_events(response: httpx.Response) -> list[dict | str]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_auth(server, alice, admin):
    anon = httpx.get(server.url + "/v1/sessions")
    assert anon.status_code == 401 and anon.json()["error"]["type"] == "authentication_error"
    wrong = httpx.get(server.url + "/v1/sessions", headers=auth("nope"))
    assert wrong.status_code == 401
    assert alice.get("/admin/cache").status_code == 403
    assert admin.get("/v1/sessions").status_code == 403
    assert httpx.get(server.url + "/healthz").json() == {"status": "ok"}
    assert httpx.get(server.url + "/readyz").status_code == 200


def test_session_multi_turn_json_and_sse(alice, admin):
    created = alice.post(
        "/v1/sessions", json={"system_prompt": "Be brief.", "metadata": {"k": "v"}}
    )
    assert created.status_code == 201
    sid = created.json()["id"]
    assert created.json()["metadata"] == {"k": "v"}
    first = alice.post(f"/v1/sessions/{sid}/messages", json={"content": "Name a fruit.", **GREEDY})
    assert first.status_code == 200, first.text
    u1 = first.json()["usage"]
    assert first.json()["message"]["content"] and u1["prompt_tokens_details"]["cached_tokens"] == 0
    second = alice.post(f"/v1/sessions/{sid}/messages", json={"content": "Another.", **GREEDY})
    u2 = second.json()["usage"]
    # The second prompt extends the saved history: all of it is reused, nothing recomputed.
    assert u2["prompt_tokens_details"]["cached_tokens"] >= u1["prompt_tokens"]
    assert second.json()["timings"]["ttft_ms"] > 0
    with alice.stream(
        "POST",
        f"/v1/sessions/{sid}/messages",
        json={"content": "One more.", "stream": True, **GREEDY},
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    done = events[-2]
    assert done["type"] == "done"
    text = "".join(e["text"] for e in events if isinstance(e, dict) and e["type"] == "delta")
    assert text == done["message"]["content"]
    assert done["usage"]["prompt_tokens_details"]["cached_tokens"] >= u2["prompt_tokens"]
    info = alice.get(f"/v1/sessions/{sid}").json()
    assert info["num_messages"] == 7 and info["num_tokens"] > u2["prompt_tokens"]
    assert [m["role"] for m in info["messages"][:3]] == ["system", "user", "assistant"]
    assert info["kv_location"] in ("dram", "ssd")
    tiers = {t["name"]: t for t in admin.get("/admin/cache").json()["tiers"]}
    before = sum(t["sessions"] for name, t in tiers.items() if name != "device")
    assert alice.delete(f"/v1/sessions/{sid}").json()["deleted"] is True
    assert alice.get(f"/v1/sessions/{sid}").status_code == 404
    assert alice.delete(f"/v1/sessions/{sid}").status_code == 404
    tiers = {t["name"]: t for t in admin.get("/admin/cache").json()["tiers"]}
    assert sum(t["sessions"] for name, t in tiers.items() if name != "device") == before - 1


def test_cross_tenant_isolation(alice, bob, admin):
    sid = alice.post("/v1/sessions", json={}).json()["id"]
    path = f"/v1/sessions/{sid}"
    assert bob.get(path).status_code == 404
    assert bob.post(path + "/messages", json={"content": "hi"}).status_code == 404
    assert bob.delete(path).status_code == 404
    assert all(s["id"] != sid for s in bob.get("/v1/sessions").json()["data"])
    assert alice.get(path).status_code == 200
    # The same id in bob's tenant is another session.
    assert bob.post("/v1/sessions", json={"id": sid}).status_code == 201
    assert alice.post("/v1/sessions", json={"id": sid}).status_code == 409
    # Prefix sharing never crosses tenants: bob sending alice's exact conversation reuses nothing.
    messages = [{"role": "user", "content": "A private question about cheese."}]
    body = {"messages": messages, **GREEDY}
    a = alice.post("/v1/chat/completions", json=body).json()
    messages += [a["choices"][0]["message"], {"role": "user", "content": "More?"}]
    a2 = alice.post("/v1/chat/completions", json={**body, "messages": messages}).json()
    assert a2["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    b2 = bob.post("/v1/chat/completions", json={**body, "messages": messages}).json()
    assert b2["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert b2["session_id"] != a2["session_id"]
    tenants = {s["tenant"] for s in admin.get("/admin/sessions?limit=100").json()["data"]}
    assert {"alice", "bob"} <= tenants


def test_pagination(bob):
    ids = {
        bob.post("/v1/sessions", json={"metadata": {"n": str(i)}}).json()["id"] for i in range(3)
    }
    seen: list[str] = []
    offset = 0
    while True:
        page = bob.get("/v1/sessions", params={"limit": 2, "offset": offset}).json()
        assert len(page["data"]) <= 2
        seen += [s["id"] for s in page["data"]]
        if not page["has_more"]:
            break
        offset = page["next_offset"]
    assert ids <= set(seen) and len(seen) == len(set(seen))


def test_admin_cache_flush_and_metrics(server, alice, admin):
    sid = alice.post("/v1/sessions", json={}).json()["id"]
    alice.post(f"/v1/sessions/{sid}/messages", json={"content": "Hello!", **GREEDY})
    cache = admin.get("/admin/cache").json()
    names = [t["name"] for t in cache["tiers"]]
    assert names[0] == "device" and "dram" in names and "ssd" in names
    tier_keys = ("capacity_bytes", "used_bytes", "sessions", "hits", "misses", "bytes_up",
                 "bytes_down", "evictions", "prefetches", "hit_rate")  # fmt: skip
    for key in tier_keys:
        assert key in cache["tiers"][1]
    for key in ("waiting", "running", "num_blocks", "free_blocks", "block_usage"):
        assert key in cache["engine"]
    assert admin.post("/admin/cache/flush", json={}).json()["flushed_sessions"] >= 1
    assert alice.get(f"/v1/sessions/{sid}").json()["kv_location"] is None
    again = alice.post(f"/v1/sessions/{sid}/messages", json={"content": "Hi again", **GREEDY})
    assert again.status_code == 200
    text = httpx.get(server.url + "/metrics").text
    names = ("http_requests_total", "tokens_total", "ttft_seconds", "engine_free_blocks",
             "store_used_bytes")  # fmt: skip
    for name in names:
        assert f"chatstore_{name}" in text


def test_long_session_is_truncated_and_keeps_its_cache(alice):
    """Past the context window the oldest history (after the system prompt) is dropped from the
    prompt and from the saved KV alike; the kept KV is reused at its new positions."""
    sid = alice.post("/v1/sessions", json={"system_prompt": "Be brief."}).json()["id"]
    words = " ".join(f"item{i}" for i in range(60))  # ~120 tokens a message
    usages = []
    for turn in range(5):
        body = {"content": f"Turn {turn}. Remember: {words}", **GREEDY}
        reply = alice.post(f"/v1/sessions/{sid}/messages", json=body)
        assert reply.status_code == 200, reply.text
        usages.append(reply.json()["usage"])
    assert all(u["prompt_tokens"] + u["completion_tokens"] <= CONTEXT for u in usages)
    truncated = 0
    for prev, u in itertools.pairwise(usages):
        saved = prev["prompt_tokens"] + prev["completion_tokens"] - 1  # the last token: no KV
        cached = u["prompt_tokens_details"]["cached_tokens"]
        if u["prompt_tokens"] > saved:  # the history fit: all of it reused
            assert cached == saved
        else:  # cut: the kept part of the saved KV is reused at its new positions
            truncated += 1
            assert 0 < cached < saved
    assert truncated >= 1
    info = alice.get(f"/v1/sessions/{sid}").json()
    assert info["num_messages"] == 11  # the history itself is kept whole


def _kv_store(server):
    return server.app.state.service.store.kv  # the AttentionStore behind the session store


def _poll_location(client, sid: str, want: str, timeout: float = 10.0) -> str | None:
    deadline = time.monotonic() + timeout
    while True:
        where = client.get(f"/v1/sessions/{sid}").json()["kv_location"]
        if where == want or time.monotonic() > deadline:
            return where
        time.sleep(0.02)


def test_prefetch_hint_moves_kv_up_and_is_tenant_checked(server, alice, bob, admin):
    sid = alice.post("/v1/sessions", json={}).json()["id"]
    assert alice.post(f"/v1/sessions/{sid}/messages", json={"content": "Hi.", **GREEDY}).is_success
    store = _kv_store(server)
    assert store.settings.async_save and store.session_policy.policy.name == "aware"
    assert alice.get(f"/v1/sessions/{sid}").json()["kv_location"] == "dram"
    push_down(store, "alice", sid)  # as if DRAM had filled up: the session is on SSD now
    assert alice.get(f"/v1/sessions/{sid}").json()["kv_location"] == "ssd"
    before = _moved_up(admin)
    assert bob.post(f"/v1/sessions/{sid}/prefetch", json={}).status_code == 404  # another tenant's
    assert alice.post("/v1/sessions/nope-unknown/prefetch", json={}).status_code == 404
    assert _kv_store(server).tier_of("alice", sid) == "ssd"  # bob moved nothing
    accepted = alice.post(f"/v1/sessions/{sid}/prefetch", json={})
    assert accepted.status_code == 202 and accepted.json()["accepted"] is True
    assert _poll_location(alice, sid, "dram") == "dram"
    # Moved once: by the prefetch thread, or by the read buffer's lookup (an SSD hit) if that
    # got there first.
    assert _moved_up(admin) == before + 1, admin.get("/admin/cache").json()["tiers"]
    deadline = time.monotonic() + 10
    while (engine := admin.get("/admin/cache").json()["engine"])["read_buffer_staged"] < 1:
        assert time.monotonic() < deadline, "the hint never staged the session's KV"
        time.sleep(0.02)
    assert engine["read_buffer_layers"] == 30 and engine["read_buffer_bytes"] > 0


def _moved_up(admin) -> int:
    tiers = admin.get("/admin/cache").json()["tiers"]
    return sum(t["prefetches"] for t in tiers) + sum(t["hits"] for t in tiers if t["name"] == "ssd")


def _key(tenant: str, sid: str):
    from chatstore.store.session_kv import SessionKey

    return SessionKey(tenant, sid)
