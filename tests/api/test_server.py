"""`chatstore serve` as a process (flags, CHATSTORE_* env, keys, one JSON log line per request,
SIGTERM -> clean exit), local mode bound to loopback, and the graceful drain: in-flight turns
finish or are aborted and the store's DRAM sessions are flushed to LMDB before exit."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from chatstore.server.launcher import local_server

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(*args: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "chatstore", "serve", *args],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_local_mode_refuses_a_public_bind(tmp_path):
    env = {"CHATSTORE_API_KEYS": "", "CHATSTORE_ADMIN_KEY": "", "CHATSTORE_DATA_DIR": str(tmp_path)}
    proc = serve("--host", "0.0.0.0", "--port", str(free_port()), env=env)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "refusing to listen" in out


def test_serve_process_with_keys_logs_and_exits_cleanly(tmp_path):
    port = free_port()
    env = {
        "CHATSTORE_API_KEYS": "k1:team1,k2:team2",
        "CHATSTORE_ADMIN_KEY": "root",
        "CHATSTORE_DATA_DIR": str(tmp_path),
        "CHATSTORE_KV_CACHE_BYTES": str(32 << 20),
        "CHATSTORE_DRAM_BYTES": str(128 << 20),
        "CHATSTORE_LOG_LEVEL": "info",
    }
    proc = serve("--port", str(port), "--model", "default", env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, url)
        assert httpx.get(url + "/v1/models").status_code == 401
        headers = {"Authorization": "Bearer k1", "X-Session-ID": "cli-session"}
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        reply = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
        assert reply.status_code == 200 and reply.headers["X-Session-ID"] == "cli-session"
        admin = httpx.get(url + "/admin/sessions", headers={"Authorization": "Bearer root"})
        assert [(s["tenant"], s["id"]) for s in admin.json()["data"]] == [("team1", "cli-session")]
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    lines = [
        json.loads(ln[ln.index("{") :]) for ln in out.splitlines() if '"event":"request"' in ln
    ]
    chat = [ln for ln in lines if ln["path"] == "/v1/chat/completions"]
    assert chat and chat[0]["session"] == "cli-session" and chat[0]["tenant"] == "team1"
    for key in ("prompt_tokens", "cached_tokens", "completion_tokens", "ttft_ms", "latency_ms"):
        assert key in chat[0]


def test_graceful_shutdown_drains_and_flushes(default_model, tmp_path):
    from chatstore.config import load_config
    from chatstore.store.attention_store import create_store

    srv = local_server(tmp_path, default_model, kv_cache_bytes=32 << 20, dram_bytes=128 << 20)
    srv.start()
    http = httpx.Client(base_url=srv.url, timeout=120)
    sid = http.post("/v1/sessions", json={}).json()["id"]
    http.post(f"/v1/sessions/{sid}/messages", json={"content": "hello", "max_tokens": 3})
    assert http.get(f"/v1/sessions/{sid}").json()["kv_location"] == "dram"
    events: list[str] = []

    def stream() -> None:
        body = {"content": "a long story", "stream": True, "max_tokens": 300, "ignore_eos": True}
        try:
            with http.stream("POST", f"/v1/sessions/{sid}/messages", json=body) as response:
                events.extend(response.iter_lines())
        except httpx.HTTPError as exc:
            events.append(f"error: {exc}")

    reader = threading.Thread(target=stream)
    reader.start()
    while not any('"delta"' in e for e in events):
        time.sleep(0.05)
    srv.stop()  # drain: the turn is aborted after the grace period; the store is closed
    reader.join(60)
    assert not reader.is_alive()
    assert srv.app.state.service.draining
    engine = srv.app.state.service.engine
    assert not engine.is_running
    pool = engine.engine.runtime.pool
    assert pool.num_free == pool.num_blocks
    # A fresh store over the same directory finds the session's KV flushed down to LMDB.
    config = load_config(overrides={"data_dir": str(tmp_path)}, env={})
    store = create_store(config, default_model.spec, default_model.fingerprint)
    try:
        assert store.tier_of("local", sid) == "ssd"
    finally:
        store.close()


def _wait_ready(proc: subprocess.Popen, url: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            if httpx.get(url + "/readyz").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not become ready"
        time.sleep(0.25)


def test_kill_9_under_load_restarts_warm(tmp_path):
    """Sessions whose last turn ended more than persist_lag_s before a kill -9 come back warm:
    after the restart their next turn reuses the whole history from LMDB."""
    port = free_port()
    env = {
        "CHATSTORE_API_KEYS": "",
        "CHATSTORE_ADMIN_KEY": "",
        "CHATSTORE_DATA_DIR": str(tmp_path),
        "CHATSTORE_KV_CACHE_BYTES": str(32 << 20),
        "CHATSTORE_PERSIST_LAG_S": "0.2",
        "CHATSTORE_CHUNK_TOKENS": "64",
    }
    url = f"http://127.0.0.1:{port}"
    proc = serve("--port", str(port), env=env)
    histories: dict[str, dict] = {}
    try:
        _wait_ready(proc, url)
        http = httpx.Client(base_url=url, timeout=120)
        for i in range(3):
            sid = http.post("/v1/sessions", json={"system_prompt": "Be brief."}).json()["id"]
            for turn in range(2):
                body = {"content": f"Session {i}, turn {turn}: name a colour.", "max_tokens": 8}
                reply = http.post(f"/v1/sessions/{sid}/messages", json={**body, "temperature": 0})
                assert reply.status_code == 200, reply.text
                histories[sid] = reply.json()["usage"]
        time.sleep(1.0)  # > persist_lag_s: every chunk of these turns has reached LMDB
        # Load while the kill lands: a turn in flight on another session.
        busy = http.post("/v1/sessions", json={}).json()["id"]
        slow = {"content": "Count from one to fifty.", "max_tokens": 200, "ignore_eos": True}
        threading.Thread(
            target=lambda: _quietly(http.post, f"/v1/sessions/{busy}/messages", json=slow),
            daemon=True,
        ).start()
        time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    proc = serve("--port", str(port), env=env)
    try:
        _wait_ready(proc, url)
        http = httpx.Client(base_url=url, timeout=120)
        for sid, usage in histories.items():
            body = {"content": "And another one?", "max_tokens": 4, "temperature": 0}
            reply = http.post(f"/v1/sessions/{sid}/messages", json=body)
            assert reply.status_code == 200, reply.text
            cached = reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            saved = usage["prompt_tokens"] + usage["completion_tokens"] - 1
            assert cached >= saved - 2, f"{sid}: {cached} of {saved} history tokens reused"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)


def _quietly(fn, *args, **kwargs) -> None:
    with contextlib.suppress(httpx.HTTPError):
        fn(*args, **kwargs)


def test_a_stopped_server_leaves_no_thread_behind(default_model, tmp_path):
    """Every thread a server starts (engine, writer, persister, prefetcher, the KV loader and
    its lookup thread, ...) ends with it: one left running holds the engine, the KV pool and
    the store, so a process that builds servers one after another (the tests) grew by ~1 GB
    each."""
    before = set(threading.enumerate())
    turn = {"max_tokens": 4, "temperature": 0}
    with (
        local_server(tmp_path, default_model, kv_cache_bytes=16 << 20) as srv,
        httpx.Client(base_url=srv.url, timeout=60) as client,
    ):
        sid = client.post("/v1/sessions", json={}).json()["id"]
        for text in ("Hi.", "Again."):  # the second turn loads the first one's KV
            r = client.post(f"/v1/sessions/{sid}/messages", json={"content": text, **turn})
            assert r.status_code == 200, r.text
        assert client.post(f"/v1/sessions/{sid}/prefetch", json={}).is_success  # stages it
        started = {t.name for t in set(threading.enumerate()) - before}
    assert {"chatstore-engine", "chatstore-loader"} <= started, started
    deadline = time.monotonic() + 10
    while left := [t.name for t in set(threading.enumerate()) - before if t.is_alive()]:
        assert time.monotonic() < deadline, f"still running after the server stopped: {left}"
        time.sleep(0.05)
