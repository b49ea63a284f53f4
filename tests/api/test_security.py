"""What a browser page may do to the server (DNS rebinding, cross-site requests, cross-site
WebSocket hijacking), /metrics behind the admin key, and keys kept out of errors and logs.
Real servers on the default model: one in local mode, one with keys."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from chatstore.api.common.settings import ServerSettings, parse_api_keys
from chatstore.server.launcher import local_server
from chatstore.server.run import RedactSecrets, install_log_redaction, uvicorn_config
from tests.api.test_limits import error_of

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

ALICE, ADMIN = "key-alice", "key-admin"
GOOD, EVIL = "http://good.example", "http://evil.example"
FLUSH = "/admin/cache/flush"
SMALL = {"kv_cache_bytes": 32 << 20, "dram_bytes": 64 << 20}


@pytest.fixture(scope="module")
def local(default_model, tmp_path_factory):
    settings = ServerSettings(allowed_hosts="chat.internal, other.internal", cors_origins=GOOD)
    data = tmp_path_factory.mktemp("api-security-local")
    with local_server(data, default_model, settings, **SMALL) as srv:
        yield srv


@pytest.fixture(scope="module")
def keyed(default_model, tmp_path_factory):
    settings = ServerSettings(api_keys={ALICE: "alice"}, admin_key=ADMIN, metrics_auth=True)
    data = tmp_path_factory.mktemp("api-security-keyed")
    with local_server(data, default_model, settings, **SMALL) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(local):
    with httpx.Client(base_url=local.url, timeout=120) as c:
        yield c


def upgrade(server, path: str, **headers: str) -> httpx.Response:
    """A WebSocket handshake by hand, to set any Host (a refusal answers it with plain HTTP)."""
    hand = {
        "Connection": "Upgrade",
        "Upgrade": "websocket",
        "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
        **headers,
    }
    return httpx.get(server.url + path, headers=hand, timeout=60)


def new_session(client: httpx.Client) -> str:
    created = client.post("/v1/sessions", json={})
    assert created.status_code == 201, created.text
    return created.json()["id"]


def test_local_mode_answers_only_loopback_hosts(http):
    err = error_of(http.get("/v1/sessions", headers={"Host": "evil.example"}), 403)
    assert err["code"] == "host_not_allowed" and "allowed_hosts" in err["message"]
    rebound = http.post(FLUSH, json={}, headers={"Host": "evil.example:8000"})
    assert error_of(rebound, 403)["code"] == "host_not_allowed"
    for host in ("localhost:8000", "LOCALHOST", "127.0.0.1:1", "[::1]:8000", "chat.internal:99"):
        assert http.get("/v1/sessions", headers={"Host": host}).status_code == 200, host
    assert http.get("/healthz", headers={"Host": "other.internal"}).status_code == 200
    assert http.get("/healthz", headers={"Host": "evil.localhost"}).status_code == 403


def test_with_keys_the_host_is_not_checked(keyed):
    headers = {"Host": "chat.example.com", "Authorization": f"Bearer {ALICE}"}
    assert httpx.get(keyed.url + "/v1/sessions", headers=headers).status_code == 200


def test_state_changing_requests_need_json(http):
    err = error_of(http.post(FLUSH), 415)
    assert err["code"] == "unsupported_media_type" and "application/json" in err["message"]
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    assert error_of(http.post(FLUSH, content=b"a=1", headers=form), 415)
    text = {"Content-Type": "text/plain"}
    chat = b'{"messages": [{"role": "user", "content": "hi"}]}'
    error_of(http.post("/v1/chat/completions", content=chat, headers=text), 415)
    sid = new_session(http)
    error_of(http.post(f"/v1/sessions/{sid}/prefetch"), 415)
    assert http.post(f"/v1/sessions/{sid}/prefetch", json={}).status_code == 202
    utf8 = {"Content-Type": "Application/JSON; charset=utf-8"}
    assert http.post(FLUSH, content=b"{}", headers=utf8).status_code == 200
    assert http.delete(f"/v1/sessions/{sid}").status_code == 200  # no body, no content type


def test_cross_origin_state_changes_are_refused(local, http):
    evil = {"Origin": EVIL}
    assert error_of(http.post(FLUSH, headers=evil), 403)["code"] == "origin_not_allowed"
    assert error_of(http.post(FLUSH, json={}, headers=evil), 403)["code"] == "origin_not_allowed"
    sid = new_session(http)
    error_of(http.delete(f"/v1/sessions/{sid}", headers=evil), 403)
    same = http.post("/v1/sessions", json={}, headers={"Origin": local.url})
    assert same.status_code == 201 and "access-control-allow-origin" not in same.headers
    allowed = http.post("/v1/sessions", json={}, headers={"Origin": GOOD})
    assert allowed.status_code == 201
    assert allowed.headers["access-control-allow-origin"] == GOOD
    assert "X-Session-ID" in allowed.headers["access-control-expose-headers"]
    error_of(http.post(FLUSH, headers={"Origin": GOOD}), 415)  # allowed, but still JSON only
    read = http.get("/v1/models", headers=evil)  # the browser may send it, not read it
    assert read.status_code == 200 and "access-control-allow-origin" not in read.headers


def test_preflight(http):
    ask = {"Access-Control-Request-Method": "POST"}
    ask["Access-Control-Request-Headers"] = "authorization,content-type"
    refused = http.options("/v1/chat/completions", headers={**ask, "Origin": EVIL})
    assert refused.status_code == 403 and "access-control-allow-origin" not in refused.headers
    ok = http.options("/v1/chat/completions", headers={**ask, "Origin": GOOD})
    assert ok.status_code == 204
    assert ok.headers["access-control-allow-origin"] == GOOD
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert ok.headers["access-control-allow-headers"] == "authorization,content-type"


def test_websocket_from_a_foreign_origin_or_host_is_refused(local, http):
    sid = new_session(http)
    url = f"{local.ws_url}/v1/sessions/{sid}/ws"
    with pytest.raises(InvalidStatus) as refused:
        connect(url, origin=EVIL, proxy=None, open_timeout=30)
    assert refused.value.response.status_code == 403
    assert b"origin_not_allowed" in refused.value.response.body
    rebound = upgrade(local, f"/v1/sessions/{sid}/ws", Host="evil.example")
    assert error_of(rebound, 403)["code"] == "host_not_allowed"
    for origin in (GOOD, local.url, None):
        with connect(url, origin=origin, proxy=None, open_timeout=30) as ws:
            assert json.loads(ws.recv(timeout=60))["type"] == "ready"


def test_metrics_auth_asks_for_the_admin_key(keyed, local):
    url = keyed.url + "/metrics"
    assert error_of(httpx.get(url), 401)["code"] == "missing_api_key"
    error_of(httpx.get(url, headers={"Authorization": f"Bearer {ALICE}"}), 403)
    scraped = httpx.get(url, headers={"Authorization": f"Bearer {ADMIN}"})
    assert scraped.status_code == 200 and "chatstore_http_requests" in scraped.text
    assert httpx.get(local.url + "/metrics").status_code == 200  # local mode: no key to ask for


def test_a_malformed_key_entry_is_named_by_position_only():
    with pytest.raises(ValueError) as bad:
        parse_api_keys("k1:team1, s3cr3t-key-without-tenant ,k3:team3")
    assert "entry 2" in str(bad.value) and "s3cr3t" not in str(bad.value)
    env = {"CHATSTORE_API_KEYS": "k1:team1,:team2"}
    with pytest.raises(ValueError, match="entry 2") as bad:
        ServerSettings.from_config(object(), env=env)
    assert "team" not in str(bad.value) and "k1" not in str(bad.value)


def test_log_filter_redacts_keys():
    record = logging.LogRecord(
        "uvicorn.error", logging.INFO, __file__, 1, '%s - "WebSocket %s" [accepted]',
        ("127.0.0.1:5000", "/v1/sessions/s1/ws?api_key=secret&x=1"), None,
    )  # fmt: skip
    assert RedactSecrets().filter(record)
    shown = '127.0.0.1:5000 - "WebSocket /v1/sessions/s1/ws?api_key=***&x=1" [accepted]'
    assert record.getMessage() == shown
    header = logging.LogRecord(
        "u", logging.DEBUG, "", 1, "< %s: %s", ("Authorization", "Bearer k"), None
    )
    RedactSecrets().filter(header)
    assert header.getMessage() == "< Authorization: Bearer ***"


def test_websocket_api_key_stays_out_of_uvicorns_log(keyed):
    install_log_redaction()  # what `chatstore serve` does when it configures logging
    with httpx.Client(base_url=keyed.url, headers={"Authorization": f"Bearer {ALICE}"}) as alice:
        sid = new_session(alice)
    logger = logging.getLogger("uvicorn.error")
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with connect(f"{keyed.ws_url}/v1/sessions/{sid}/ws?api_key={ALICE}", proxy=None) as ws:
            assert json.loads(ws.recv(timeout=60))["type"] == "ready"
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert any("api_key=***" in line for line in lines), lines
    assert not any(ALICE in line for line in lines), lines


def test_uvicorn_caps_websocket_frames_like_bodies():
    settings = ServerSettings(max_body_bytes=123_456)
    assert uvicorn_config(object(), settings).ws_max_size == settings.max_body_bytes
