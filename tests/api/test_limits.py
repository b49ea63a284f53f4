"""Bad input and limits against a real server: malformed JSON, invalid UTF-8, huge bodies,
out-of-range numbers, unknown fields, unknown sessions, a full queue (429 + Retry-After),
draining (503); then schemathesis over the server's own OpenAPI schema: no 5xx, no crash."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from chatstore.api.common.settings import ServerSettings
from chatstore.server.launcher import local_server

pytestmark = [pytest.mark.model, pytest.mark.timeout(400)]

MAX_BODY = 64 * 1024
CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(default_model, tmp_path_factory):
    settings = ServerSettings(max_body_bytes=MAX_BODY, max_message_chars=2000)
    data = tmp_path_factory.mktemp("api-limits")
    srv = local_server(
        data,
        default_model,
        settings,
        kv_cache_bytes=32 << 20,
        dram_bytes=128 << 20,
        max_running=1,
        max_waiting=1,
    )
    with srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_malformed_bodies(http):
    headers = {"Content-Type": "application/json"}
    err = error_of(http.post(CHAT, content=b'{"messages": [', headers=headers), 400)
    assert err["code"] == "invalid_json"
    bad_utf8 = b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'
    error_of(http.post(CHAT, content=bad_utf8, headers=headers), 400)
    error_of(http.post(CHAT, content=b"[1, 2]", headers=headers), 400)
    error_of(http.post(CHAT, content=b"", headers=headers), 400)
    nan = b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}'
    assert error_of(http.post(CHAT, content=nan, headers=headers), 400)["param"] == "temperature"


def test_body_and_message_limits(http):
    huge = {"messages": [{"role": "user", "content": "x" * (2 * MAX_BODY)}]}
    assert error_of(http.post(CHAT, json=huge), 413)["code"] == "too_large"

    def chunks():  # no Content-Length: the limit holds for a streamed body too
        for _ in range(4):
            yield b" " * MAX_BODY

    error_of(http.post(CHAT, content=chunks(), headers={"Content-Type": "application/json"}), 413)
    long = {"messages": [{"role": "user", "content": "y" * 3000}]}
    err = error_of(http.post(CHAT, json=long), 400)
    assert err["param"] == "messages.0.content" and err["code"] == "too_long"
    sid = http.post("/v1/sessions", json={}).json()["id"]
    err = error_of(http.post(f"/v1/sessions/{sid}/messages", json={"content": "z" * 3000}), 400)
    assert err["param"] == "content"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", -1),
        ("max_tokens", 0),
        ("max_tokens", 10**12),
        ("max_completion_tokens", -5),
        ("temperature", 1e308),
        ("temperature", "hot"),
        ("top_p", 0),
        ("n", 0),
        ("n", 10**9),
        ("seed", 2**80),
        ("presence_penalty", -3),
        ("frequency_penalty", 99),
        ("logit_bias", {"not-a-token": 1}),
        ("logit_bias", {"5": 1000}),
        ("stop", ["a", "b", "c", "d", "e"]),
        ("stop", [""]),
        ("messages", "hello"),
        ("stream", "maybe"),
    ],
)
def test_invalid_parameters_name_the_field(http, field, value):
    err = error_of(http.post(CHAT, json={"messages": HELLO, field: value}), 400)
    assert err["param"].split(".")[0] == field


def test_unknown_fields_and_sessions(http):
    ok = http.post(CHAT, json={"messages": HELLO, "max_tokens": 2, "frobnicate": {"x": 1}})
    assert ok.status_code == 200  # OpenAI clients send fields we do not know: ignored
    err = error_of(http.post("/v1/sessions", json={"frobnicate": 1}), 400)
    assert err["param"] == "frobnicate"  # our own API is strict
    err = error_of(http.post("/v1/sessions/nope/messages", json={"content": "hi"}), 404)
    assert err["type"] == "not_found_error"
    error_of(http.get("/v1/sessions/nope"), 404)
    error_of(http.delete("/v1/sessions/nope"), 404)
    error_of(http.get("/v1/sessions/bad%20id"), 400)
    error_of(http.get("/v1/nothing-here"), 404)
    error_of(http.put(CHAT, json={}), 405)
    error_of(http.get("/v1/sessions", params={"limit": -1}), 400)
    header = {"X-Session-ID": "no spaces allowed"}
    error_of(http.post(CHAT, json={"messages": HELLO}, headers=header), 400)


def test_full_queue_is_429_with_retry_after(server):
    body = {"messages": HELLO, "max_tokens": 24, "temperature": 0, "ignore_eos": True}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            return await asyncio.gather(*(c.post(CHAT, json=body) for _ in range(6)))

    responses = asyncio.run(burst())
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) == {200, 429}, statuses
    refused = [r for r in responses if r.status_code == 429]
    assert all(int(r.headers["Retry-After"]) >= 1 for r in refused)
    assert refused[0].json()["error"]["type"] == "rate_limit_error"


def test_draining_is_503(server, http):
    service = server.app.state.service
    service.draining = True
    try:
        err = error_of(http.post(CHAT, json={"messages": HELLO}), 503)
        assert err["code"] == "draining"
        assert http.post(CHAT, json={"messages": HELLO}).headers["Retry-After"]
        assert http.get("/readyz").status_code == 503
        assert http.get("/healthz").status_code == 200
    finally:
        service.draining = False


def shorten(case) -> None:
    """Keep generations short: this checks the API, not the model."""
    generates = case.path.endswith(("/messages", "/chat/completions"))
    if not generates or not isinstance(case.body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(case.body.get(key), int) and case.body[key] > 2:
            case.body[key] = 2
    case.body.setdefault("max_tokens", 2)
    if isinstance(case.body.get("n"), int) and case.body["n"] > 2:
        case.body["n"] = 2


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_schemathesis_no_server_errors(server, mode):
    """Every operation of the server's own OpenAPI schema, valid and invalid inputs, a few
    examples each (bounded in count and time): never a 5xx, and the server stays up."""
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10

    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=6,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case) -> None:
            shorten(case)
            case.call_and_validate(base_url=server.url, checks=[not_a_server_error], timeout=120)

        try:
            check()
        except Unsatisfiable:  # nothing to make invalid (an operation without inputs)
            assert mode == GenerationMode.NEGATIVE
    assert httpx.get(server.url + "/healthz").status_code == 200
