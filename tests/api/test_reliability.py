"""Reliability of the API against a real server (real default model, engine, store and LMDB):
a turn is acknowledged only once its record is durable, deleted sessions stay deleted, store
work stays off the event loop, tenant limits hold, expired sessions are purged."""

from __future__ import annotations

import json
import threading
import time
from contextlib import ExitStack
from dataclasses import replace

import httpx
import pytest
from websockets.sync.client import connect

from chatstore.api.common.settings import KEYED_TURNS_PER_TENANT, ServerSettings
from chatstore.server.launcher import local_server
from chatstore.store.session_kv import SessionKey

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

GREEDY = {"temperature": 0, "max_tokens": 4}
BIG_METADATA = {f"k{i}": "x" * 900 for i in range(16)}  # ~15 KB as JSON, under the 16 KB cap


def sse_events(response: httpx.Response) -> list[dict | str]:
    out: list[dict | str] = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.fixture(scope="module")
def server(default_model, tmp_path_factory):
    settings = ServerSettings(max_sessions_per_tenant=400, max_messages=9, purge_interval_s=0)
    srv = local_server(
        tmp_path_factory.mktemp("reliability"),
        default_model,
        settings,
        kv_cache_bytes=32 << 20,
        dram_bytes=64 << 20,
        records_map_bytes=1 << 20,  # small: the full-store test fills it
        max_context_tokens=512,
    )
    with srv:
        yield srv


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _fill_records(client: httpx.Client) -> list[str]:
    """Sessions until the records map refuses (507): big ones first, then bare ones."""
    filler: list[str] = []
    for body in ({"metadata": BIG_METADATA}, {}):
        for _ in range(400):
            r = client.post("/v1/sessions", json=body)
            if r.status_code == 507:
                assert r.json()["error"]["code"] == "store_full"
                break
            assert r.status_code == 201, r.text
            filler.append(r.json()["id"])
        else:
            pytest.fail("the 1 MiB records map never filled")
    return filler


def test_full_record_store_refuses_the_turn_and_keeps_the_session(client, server):
    sid = client.post("/v1/sessions", json={"system_prompt": "Be brief."}).json()["id"]
    first = client.post(f"/v1/sessions/{sid}/messages", json={"content": "Hi.", **GREEDY})
    assert first.status_code == 200, first.text
    before = client.get(f"/v1/sessions/{sid}").json()
    filler = _fill_records(client)
    try:
        # JSON: 507 with a message, never 200 for a turn whose record was not kept.
        lost = client.post(f"/v1/sessions/{sid}/messages", json={"content": "Lost?", **GREEDY})
        assert lost.status_code == 507, lost.text
        assert "full" in lost.json()["error"]["message"]
        # SSE: the deltas went out, then an error event instead of `done`.
        body = {"content": "Lost too?", "stream": True, **GREEDY}
        with client.stream("POST", f"/v1/sessions/{sid}/messages", json=body) as response:
            events = sse_events(response)
        kinds = [e.get("type") if isinstance(e, dict) else e for e in events]
        assert "done" not in kinds and events[-2]["error"]["code"] == "store_full"
        # WebSocket: an `error` frame, no `done`.
        ws_url = server.ws_url + f"/v1/sessions/{sid}/ws"
        with connect(ws_url, open_timeout=10) as ws:
            assert json.loads(ws.recv(timeout=10))["type"] == "ready"
            ws.send(json.dumps({"type": "message", "content": "And this?", **GREEDY}))
            while True:
                frame = json.loads(ws.recv(timeout=60))
                if frame["type"] in ("done", "error"):
                    break
            assert frame["type"] == "error" and frame["error"]["code"] == "store_full"
        after = client.get(f"/v1/sessions/{sid}").json()
        assert after["messages"] == before["messages"]  # left as it was
    finally:
        for fid in filler:  # deletes still work on a full store, and free its room
            assert client.delete(f"/v1/sessions/{fid}").status_code == 200
    again = client.post(f"/v1/sessions/{sid}/messages", json={"content": "Back?", **GREEDY})
    assert again.status_code == 200, again.text
    messages = client.get(f"/v1/sessions/{sid}").json()["messages"]
    assert [m["content"] for m in messages if m["role"] == "user"] == ["Hi.", "Back?"]


def test_deleted_session_does_not_come_back_after_a_dropped_turn(client, server):
    store = server.app.state.service.store.kv
    for _ in range(3):
        sid = client.post("/v1/sessions", json={}).json()["id"]
        body = {"content": "Count.", "stream": True, "max_tokens": 64, "ignore_eos": True}
        with client.stream("POST", f"/v1/sessions/{sid}/messages", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and '"delta"' in line:
                    break  # drop the connection mid-reply: the turn is aborted
        deadline = time.monotonic() + 30
        while (r := client.delete(f"/v1/sessions/{sid}")).status_code == 409:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert r.status_code == 200
        time.sleep(0.3)  # the engine applies the abort and saves what the turn computed
        assert store.flush_writes(30)
        assert client.get(f"/v1/sessions/{sid}").status_code == 404
        assert store.records.get(SessionKey("local", sid)) is None
        assert store.find("local", sid) is None


OPEN_STALL_S = 3.0  # how long the slow records read below holds a turn's opening


def test_healthz_answers_while_a_turn_waits_on_the_store(client, server):
    """Opening a turn reads records and may wait on a pending save: that wait must not hold
    the event loop (a slow records read stands in for a 30 s wait on a pending save)."""
    sid = client.post("/v1/sessions", json={}).json()["id"]
    adapter = server.app.state.service.store
    real_get = adapter.get

    def slow_get(tenant: str, session_id: str):
        if session_id == sid:
            time.sleep(OPEN_STALL_S)
        return real_get(tenant, session_id)

    adapter.get = slow_get
    try:
        done = threading.Event()

        def post() -> None:
            with httpx.Client(base_url=server.url, timeout=60) as c:
                c.post(f"/v1/sessions/{sid}/messages", json={"content": "Hi.", **GREEDY})
            done.set()

        thread = threading.Thread(target=post)
        thread.start()
        time.sleep(0.2)
        worst = 0.0
        while not done.is_set():
            t0 = time.perf_counter()
            assert client.get("/healthz").status_code == 200
            worst = max(worst, time.perf_counter() - t0)
            time.sleep(0.02)
        thread.join()
    finally:
        del adapter.get
    # Blocked behind the turn's opening, a probe would take up to OPEN_STALL_S: half is a
    # liveness bound, not a speed.
    assert worst < OPEN_STALL_S / 2, f"/healthz took {worst:.2f}s while a turn opened"


def test_limits_metadata_messages_sessions_turns(client, server):
    too_big = {f"k{i}": "x" * 1000 for i in range(20)}
    r = client.post("/v1/sessions", json={"metadata": too_big})
    assert r.status_code == 400 and r.json()["error"]["param"] == "metadata"
    # A session keeps at most max_messages (9): 1 system + 4 turns of 2.
    sid = client.post("/v1/sessions", json={"system_prompt": "Be brief."}).json()["id"]
    for i in range(4):
        ok = client.post(f"/v1/sessions/{sid}/messages", json={"content": f"Hi {i}", **GREEDY})
        assert ok.status_code == 200, ok.text
    full = client.post(f"/v1/sessions/{sid}/messages", json={"content": "More", **GREEDY})
    assert full.status_code == 400 and full.json()["error"]["code"] == "session_full"
    service = server.app.state.service
    # Turns in flight per tenant.
    limit = service.settings.max_turns_per_tenant
    service.settings = replace(service.settings, max_turns_per_tenant=1)
    try:
        a = client.post("/v1/sessions", json={}).json()["id"]
        b = client.post("/v1/sessions", json={}).json()["id"]
        # a's turn is in flight from its first event to [DONE]: b posts right after that first
        # event and is answered at once, so 200 tokens keep a busy with a wide margin.
        body = {"content": "Count.", "stream": True, "max_tokens": 200, "ignore_eos": True}
        with client.stream("POST", f"/v1/sessions/{a}/messages", json=body) as response:
            lines = response.iter_lines()  # kept: a dropped iterator closes the stream
            assert next(lines).startswith("data: ")
            busy = client.post(f"/v1/sessions/{b}/messages", json={"content": "x", **GREEDY})
            assert [ln for ln in lines if ln][-1] == "data: [DONE]"
            assert busy.status_code == 429 and "Retry-After" in busy.headers
            assert busy.json()["error"]["code"] == "tenant_busy"
        assert client.post(f"/v1/sessions/{b}/messages", json={"content": "x", **GREEDY}).is_success
    finally:
        service.settings = replace(service.settings, max_turns_per_tenant=limit)
    # Sessions per tenant (counted from the tenant's own records).
    count = service.store.count_sessions("local")
    service.settings = replace(service.settings, max_sessions_per_tenant=count)
    try:
        r = client.post("/v1/sessions", json={})
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_sessions"
        implicit = client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "new"}]}
        )
        assert implicit.status_code == 429
    finally:
        service.settings = replace(service.settings, max_sessions_per_tenant=400)


def test_turns_per_tenant_cap_is_for_keyed_tenants_only():
    local, keyed = ServerSettings(), ServerSettings(api_keys={"k": "a"})
    assert local.turns_per_tenant is None  # one user: the engine's queue bounds it
    assert keyed.turns_per_tenant == KEYED_TURNS_PER_TENANT
    assert replace(local, max_turns_per_tenant=3).turns_per_tenant == 3
    assert replace(keyed, max_turns_per_tenant=40).turns_per_tenant == 40


def test_local_mode_runs_more_streams_than_the_keyed_cap(default_model, tmp_path):
    """One user in local mode may have as many turns in flight as the engine batches: more
    than a keyed tenant's cap, all streaming at once."""
    streams = KEYED_TURNS_PER_TENANT + 4
    srv = local_server(tmp_path, default_model, kv_cache_bytes=256 << 20, max_running=32)
    body = {"content": "Count.", "stream": True, "max_tokens": 300, "ignore_eos": True}
    lines = []  # kept: a dropped iterator closes its stream
    with srv, httpx.Client(base_url=srv.url, timeout=120) as client, ExitStack() as open_streams:
        for _ in range(streams):
            sid = client.post("/v1/sessions", json={}).json()["id"]
            response = open_streams.enter_context(
                client.stream("POST", f"/v1/sessions/{sid}/messages", json=body)
            )
            assert response.status_code == 200, response.read()
            lines.append(response.iter_lines())
            assert next(lines[-1]).startswith("data: ")  # in flight
        assert srv.app.state.service.turns_in_flight("local") == streams


def test_expired_sessions_are_purged_on_a_timer(default_model, tmp_path):
    settings = ServerSettings(purge_interval_s=0.2)
    srv = local_server(tmp_path, default_model, settings, kv_cache_bytes=16 << 20, session_ttl_s=1)
    with srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        sid = client.post("/v1/sessions", json={}).json()["id"]
        r = client.post(f"/v1/sessions/{sid}/messages", json={"content": "Hi.", **GREEDY})
        assert r.status_code == 200
        store = srv.app.state.service.store.kv
        key = SessionKey("local", sid)
        assert store.records._load(key) is not None and store.find("local", sid) is not None
        deadline = time.monotonic() + 10
        while store.records._load(key) is not None:  # the raw record, not the TTL-filtered one
            assert time.monotonic() < deadline, "the expired session was never purged"
            time.sleep(0.1)
        assert store.find("local", sid) is None


class _Fatal(BaseException):
    """Not an Exception: nothing inside an engine step catches it; the model thread dies."""


def test_engine_death_reaches_every_client_as_an_error(default_model, tmp_path):
    srv = local_server(tmp_path, default_model, ServerSettings(), kv_cache_bytes=16 << 20)
    with srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        engine = srv.app.state.service.engine.engine
        step = engine.step
        armed = threading.Event()

        def dying_step(*args, **kwargs):
            if armed.is_set():
                raise _Fatal("cosmic ray")
            return step(*args, **kwargs)

        engine.step = dying_step
        sse_sid = client.post("/v1/sessions", json={}).json()["id"]
        ws_sid = client.post("/v1/sessions", json={}).json()["id"]
        long = {"content": "Count.", "max_tokens": 300, "ignore_eos": True}
        with (
            connect(srv.ws_url + f"/v1/sessions/{ws_sid}/ws", open_timeout=10) as ws,
            client.stream(
                "POST", f"/v1/sessions/{sse_sid}/messages", json={**long, "stream": True}
            ) as response,
        ):
            assert json.loads(ws.recv(timeout=10))["type"] == "ready"
            ws.send(json.dumps({"type": "message", **long}))
            assert json.loads(ws.recv(timeout=10))["type"] == "start"
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            armed.set()
            events = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
            assert "error" in events[-1] and events[-1]["error"]["code"] == "engine_error"
            while (frame := json.loads(ws.recv(timeout=10)))["type"] == "delta":
                pass
            assert frame["type"] == "error" and "cosmic ray" in frame["error"]["message"]
        after = client.post(f"/v1/sessions/{sse_sid}/messages", json={"content": "Hi."})
        assert after.status_code == 503 and after.json()["error"]["code"] == "engine_failed"
        assert client.get("/readyz").status_code == 503
        assert client.get("/healthz").status_code == 200
