"""WebSocket turns, and cancellation: a cancel frame or a client going away (WebSocket or SSE)
aborts the generation and its KV blocks return to the pool. Real server, local mode."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from websockets.sync.client import connect

from chatstore.server.launcher import local_server
from tests.support.store import push_down

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

LONG = {"temperature": 0, "max_tokens": 400, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(default_model, tmp_path_factory):
    data = tmp_path_factory.mktemp("api-ws")
    with local_server(data, default_model, kv_cache_bytes=48 << 20, dram_bytes=256 << 20) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def ws_connect(server, sid: str):
    return connect(f"{server.ws_url}/v1/sessions/{sid}/ws", proxy=None, open_timeout=30)


def recv(ws) -> dict:
    return json.loads(ws.recv(timeout=120))


def until(ws, kind: str) -> tuple[dict, list[dict]]:
    seen = []
    while True:
        frame = recv(ws)
        seen.append(frame)
        if frame["type"] in (kind, "error"):
            return frame, seen


def wait_idle(http, timeout: float = 30.0) -> dict:
    """Engine stats once nothing runs or waits (every block back in the pool)."""
    deadline = time.monotonic() + timeout
    while True:
        engine = http.get("/admin/cache").json()["engine"]
        idle = engine["running"] == 0 and engine["waiting"] == 0
        if (idle and engine["free_blocks"] == engine["num_blocks"]) or time.monotonic() > deadline:
            return engine
        time.sleep(0.05)


def test_ws_multi_turn(server, http):
    sid = http.post("/v1/sessions", json={"system_prompt": "Answer briefly."}).json()["id"]
    with ws_connect(server, sid) as ws:
        assert recv(ws) == {"type": "ready", "session_id": sid}
        ws.send(json.dumps({"type": "typing"}))
        ws.send(json.dumps({"type": "ping"}))
        assert recv(ws) == {"type": "pong"}
        turn = {"type": "message", "content": "Name a planet.", "max_tokens": 6, "temperature": 0}
        ws.send(json.dumps(turn))
        first, frames = until(ws, "done")
        assert first["type"] == "done", first
        assert frames[0]["type"] == "start"
        text = "".join(f["text"] for f in frames if f["type"] == "delta")
        assert text == first["message"]["content"]
        assert first["timings"]["ttft_ms"] > 0
        ws.send(json.dumps({"type": "message", "content": "Another.", "max_tokens": 6}))
        second, _ = until(ws, "done")
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= first["usage"]["prompt_tokens"]
        ws.send(json.dumps({"type": "bogus"}))
        assert recv(ws)["error"]["param"] == "type"
        ws.send(json.dumps({"type": "message", "content": "x", "top_p": 5}))
        assert recv(ws)["error"]["param"] == "top_p"
    assert http.get(f"/v1/sessions/{sid}").json()["num_messages"] == 5


def test_ws_unknown_session_is_refused(server):
    with ws_connect(server, "no-such-session") as ws:
        frame = recv(ws)
        assert frame["type"] == "error" and frame["error"]["code"] == "not_found"


def test_ws_cancel_then_continue(server, http):
    sid = http.post("/v1/sessions", json={}).json()["id"]
    with ws_connect(server, sid) as ws:
        recv(ws)
        ws.send(json.dumps({"type": "message", "content": "Tell me a long story.", **LONG}))
        until(ws, "delta")
        ws.send(json.dumps({"type": "cancel"}))
        frame, _ = until(ws, "cancelled")
        assert frame["type"] == "cancelled"
        engine = wait_idle(http)
        assert engine["free_blocks"] == engine["num_blocks"]
        ws.send(json.dumps({"type": "message", "content": "Short answer: hi?", "max_tokens": 4}))
        done, _ = until(ws, "done")
        assert done["type"] == "done"


def test_ws_disconnect_frees_blocks(server, http):
    sid = http.post("/v1/sessions", json={}).json()["id"]
    ws = ws_connect(server, sid)
    recv(ws)
    ws.send(json.dumps({"type": "message", "content": "Write a long essay.", **LONG}))
    until(ws, "delta")
    assert http.get("/admin/cache").json()["engine"]["running"] == 1
    ws.close()
    engine = wait_idle(http)
    assert engine["running"] == 0 and engine["free_blocks"] == engine["num_blocks"]


def test_sse_disconnect_frees_blocks(server, http):
    body = {"messages": [{"role": "user", "content": "Write a long poem."}], "stream": True, **LONG}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        while "content" not in next(lines):
            pass
        assert http.get("/admin/cache").json()["engine"]["running"] == 1
    engine = wait_idle(http)
    assert engine["running"] == 0 and engine["free_blocks"] == engine["num_blocks"]


def test_non_stream_disconnect_frees_blocks(server, http):
    body = {"messages": [{"role": "user", "content": "Write a long letter."}], **LONG}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=1.5)
    engine = wait_idle(http)
    assert engine["running"] == 0 and engine["free_blocks"] == engine["num_blocks"]


def test_ws_typing_prefetches_the_session(server, http):
    sid = http.post("/v1/sessions", json={}).json()["id"]
    turn = {"type": "message", "content": "Hi.", "max_tokens": 4, "temperature": 0}
    with ws_connect(server, sid) as ws:
        assert recv(ws)["type"] == "ready"
        ws.send(json.dumps(turn))
        assert until(ws, "done")[0]["type"] == "done"
        assert http.get(f"/v1/sessions/{sid}").json()["kv_location"] == "dram"
        push_down(server.app.state.service.store.kv, "local", sid)  # pushed down to SSD
        assert http.get(f"/v1/sessions/{sid}").json()["kv_location"] == "ssd"
        ws.send(json.dumps({"type": "typing"}))
        deadline = time.monotonic() + 10
        while http.get(f"/v1/sessions/{sid}").json()["kv_location"] != "dram":
            assert time.monotonic() < deadline, "typing did not bring the KV up to DRAM"
            time.sleep(0.02)
