"""cached_tokens_by_tier on a real server (default model, engine, store with LMDB and a real
Redis): each reused prompt token counts where its KV was when the turn opened - the device
prefix cache, DRAM, SSD or Redis - in JSON replies, the SSE `done` event and the WS `done` frame.
"""

from __future__ import annotations

import json

import httpx
import pytest
from websockets.sync.client import connect

from chatstore.api.common.settings import ServerSettings
from chatstore.server.launcher import local_server
from chatstore.store.attention_store import AttentionStore
from chatstore.store.session_kv import SessionKey
from tests.api.test_sessions import sse_events

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

KEY = "key-alice"
TENANT = "alice"
CHUNK = 32  # tokens per stored chunk: a short conversation spans several
SYSTEM = (
    "You are a careful assistant for a small bakery. Answer in one short sentence, name "
    "the bread when you can, and never list more than one item. Prices are in euros."
)
GREEDY = {"temperature": 0, "max_tokens": 5}


def serve(default_model, data_dir, **overrides):
    settings = ServerSettings(api_keys={KEY: TENANT}, purge_interval_s=0)
    return local_server(
        data_dir,
        default_model,
        settings,
        kv_cache_bytes=32 << 20,
        dram_bytes=64 << 20,
        chunk_tokens=CHUNK,
        **overrides,
    )


@pytest.fixture(scope="module")
def server(default_model, redis_server, tmp_path_factory):
    """No device prefix cache here: every reused token comes from the store."""
    import redis as redis_lib

    with redis_lib.Redis.from_url(redis_server.url) as client:
        client.flushall()
    data = tmp_path_factory.mktemp("cached-by-tier")
    srv = serve(
        default_model,
        data,
        enable_prefix_cache=False,
        redis_url=redis_server.url,
        redis_bytes=64 << 20,
    )
    with srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=120) as c:
        yield c


def store_of(server) -> AttentionStore:
    return server.app.state.service.store.kv


def split(usage: dict) -> dict[str, int]:
    by_tier = usage["cached_tokens_by_tier"]
    assert sum(by_tier.values()) == usage["prompt_tokens_details"]["cached_tokens"]
    return by_tier


def move(store: AttentionStore, sid: str, chunks: range, to: str) -> None:
    """Leave the session's chunks at `chunks` only in tier `to` ("ssd" or "remote"), as
    pressure (eviction) or another replica (a chain saved elsewhere) would leave them."""
    store.wait_saved(TENANT, sid)
    store.flush_persist(30)
    chain = store.index.get(SessionKey(TENANT, sid))
    assert chain is not None
    for i in chunks:
        chunk = chain.chunks[i]
        copied = store.tiers.persist(chunk) if to == "ssd" else store.tiers.share(chunk)
        assert copied, f"chunk {i} did not reach {to}"
        with store.tiers.lock:
            store.tier("dram").delete(chunk)
        if to == "remote":
            store.tier("ssd").delete(chunk)
        assert store.tiers.where(chunk) == to


def num_tokens(http, sid: str) -> int:
    return http.get(f"/v1/sessions/{sid}").json()["num_tokens"]


def test_turns_count_their_history_by_tier(server, http):
    store = store_of(server)
    sid = http.post("/v1/sessions", json={"system_prompt": SYSTEM}).json()["id"]
    first = http.post(f"/v1/sessions/{sid}/messages", json={"content": "Rye?", **GREEDY})
    assert first.status_code == 200, first.text
    assert split(first.json()["usage"]) == {"device": 0, "dram": 0, "ssd": 0, "remote": 0}

    # Turn 2: the whole saved history is reused, from DRAM.
    saved = num_tokens(http, sid)
    assert saved > CHUNK  # two chunks at least
    second = http.post(f"/v1/sessions/{sid}/messages", json={"content": "Spelt?", **GREEDY})
    usage = second.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == saved
    assert split(usage) == {"device": 0, "dram": saved, "ssd": 0, "remote": 0}

    # Turn 3 (SSE): the first chunk was pushed down to SSD, the rest is still in DRAM.
    saved = num_tokens(http, sid)
    move(store, sid, range(1), "ssd")
    body = {"content": "Oat?", "stream": True, **GREEDY}
    with http.stream("POST", f"/v1/sessions/{sid}/messages", json=body) as response:
        assert response.status_code == 200
        events = sse_events(response)
    done = events[-2]
    assert done["type"] == "done"
    assert done["usage"]["prompt_tokens_details"]["cached_tokens"] == saved
    assert split(done["usage"]) == {"device": 0, "dram": saved - CHUNK, "ssd": CHUNK, "remote": 0}

    # Turn 4 (WebSocket): every chunk is only in Redis; the turn-opening fetch brings them up
    # to DRAM before the engine reads them, and they count as remote.
    saved = num_tokens(http, sid)
    chain = store.index.get(SessionKey(TENANT, sid))
    assert chain is not None
    move(store, sid, range(len(chain.chunks)), "remote")
    url = f"{server.ws_url}/v1/sessions/{sid}/ws?api_key={KEY}"
    with connect(url, proxy=None, open_timeout=30) as ws:
        assert json.loads(ws.recv(timeout=60))["type"] == "ready"
        ws.send(json.dumps({"type": "message", "content": "Wheat?", **GREEDY}))
        while (frame := json.loads(ws.recv(timeout=120)))["type"] not in ("done", "error"):
            pass
    assert frame["type"] == "done", frame
    assert frame["usage"]["prompt_tokens_details"]["cached_tokens"] == saved
    assert split(frame["usage"]) == {"device": 0, "dram": 0, "ssd": 0, "remote": saved}
    assert store.tiers.where(chain.chunks[0]) == "dram"  # brought up for the turn


def test_device_prefix_cache_hits_count_as_device(default_model, tmp_path):
    """With the engine's prefix cache on, a new session that shares a system prompt with one
    that just ran reuses those blocks from the device pool: nothing comes from the store."""
    with serve(default_model, tmp_path) as server:
        headers = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(base_url=server.url, headers=headers, timeout=120) as http:
            a = http.post("/v1/sessions", json={"system_prompt": SYSTEM}).json()["id"]
            http.post(f"/v1/sessions/{a}/messages", json={"content": "Rye?", **GREEDY})
            b = http.post("/v1/sessions", json={"system_prompt": SYSTEM}).json()["id"]
            reply = http.post(f"/v1/sessions/{b}/messages", json={"content": "Oat?", **GREEDY})
            usage = reply.json()["usage"]
            device = usage["cached_tokens_by_tier"]["device"]
            assert device > 0 and device % 16 == 0  # whole blocks of the shared prefix
            assert split(usage) == {"device": device, "dram": 0, "ssd": 0, "remote": 0}
            # Chat Completions (stream with usage) on b's next turn: both sources add up.
            body = {
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "Oat?"},
                    {"role": "assistant", "content": reply.json()["message"]["content"]},
                    {"role": "user", "content": "Barley?"},
                ],
                "session_id": b,
                "stream": True,
                "stream_options": {"include_usage": True},
                **GREEDY,
            }
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                events = sse_events(response)
            final = events[-2]
            assert final["choices"] == []
            by_tier = split(final["usage"])
            assert final["usage"]["prompt_tokens_details"]["cached_tokens"] > usage["prompt_tokens"]
            assert by_tier["device"] >= device  # the shared prefix is still in the pool
            assert by_tier["ssd"] == by_tier["remote"] == 0
