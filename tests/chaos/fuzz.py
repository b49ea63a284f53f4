"""Fuzzed requests must never get a 5xx (nor hang): Schemathesis over the whole OpenAPI schema
(positive and negative cases), then hand-made hostile input on every route:

    malformed JSON, invalid UTF-8, deep nesting
    huge, negative, fractional, non-finite and mistyped values in every numeric field (sampling
    fields in the body, offset/limit in the query, logit_bias ids and weights)
    the same over the WebSocket (not in the schema): an error frame, never an internal one

Local mode: Host 127.0.0.1, JSON bodies. A small context (max_context_tokens) and a small
default max_tokens keep the generations a fuzzer asks for short.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests.chaos.harness import ServerProcess, http_client

NUMERIC_FIELDS = (
    "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed",
    "presence_penalty", "frequency_penalty", "repetition_penalty",
)  # fmt: skip
# Raw JSON literals: Python's json (and so FastAPI) reads NaN, Infinity and 1e999 (inf) too.
VALUES = (
    "-1", "0", "1.5", "-0.0", "2147483648", "-9223372036854775809", "18446744073709551616",
    "1" + "0" * 40, "1e308", "-1e308", "1e999", "NaN", "Infinity", "-Infinity",
    '"7"', "true", "null", "[]", "{}",
)  # fmt: skip
BASE_BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "/v1/sessions/{session_id}/messages": {"content": "hi", "max_tokens": 1},
}
MALFORMED = (
    b"{", b'{"content": ', b"[1, 2", b"null", b'"text"', b'{"content": "hi"}}', b"\x00",
    b'{"content": "\xff\xfe\xfd"}', b'{"content": "\xc3\x28"}', b"\xef\xbb\xbf{}",
    b'{"content": "\\ud800"}', b"[" * 5000 + b"]" * 5000,
    b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 1}',
    b'{"messages": [{"role": "user", "content": "' + b"\xe2\x82" + b'"}]}',
)  # fmt: skip
SID = "fuzz-session"
INTERNAL = ("internal_error", "engine_error", "engine_failed")  # a WebSocket's 5xx


@dataclass
class FuzzConfig:
    max_examples: int = 8  # per operation and generation mode
    schema_budget_s: float = 45.0
    request_timeout_s: float = 30.0
    derandomize: bool = True
    seed: int = 12


@dataclass
class FuzzReport:
    operations: int = 0
    schema_requests: int = 0
    handmade_requests: int = 0
    statuses: Counter = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)  # 5xx (and internal WS errors)
    hangs: list[str] = field(default_factory=list)  # no answer within request_timeout_s
    seconds: float = 0.0


def run(work: Path, config: FuzzConfig, say: Callable[[str], None] = print) -> FuzzReport:
    t0 = time.monotonic()
    report = FuzzReport()
    env = {
        "CHATSTORE_MAX_CONTEXT_TOKENS": "128",
        "CHATSTORE_DEFAULT_MAX_TOKENS": "8",
        "CHATSTORE_MAX_TURNS_PER_TENANT": "64",
        "CHATSTORE_PURGE_INTERVAL_S": "0",
    }
    with ServerProcess(work / "data", env) as server:
        _schema(server, config, report)
        say(f"  schemathesis: {report.schema_requests} requests, {dict(report.statuses)}")
        with server.client(config.request_timeout_s) as http:
            _handmade(http, server, report)
        _websocket(server, report)
        say(f"  hand-made: {report.handmade_requests} requests")
    report.seconds = time.monotonic() - t0
    return report


# -- Schemathesis --------------------------------------------------------------------------------


def _schema(server: ServerProcess, config: FuzzConfig, report: FuzzReport) -> None:
    import schemathesis

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", timeout=30)
    operations = [result.ok() for result in schema.get_all_operations()]
    report.operations = len(operations)
    modes = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
    slots = [(op, mode) for op in operations for mode in modes]
    deadline = time.monotonic() + config.schema_budget_s
    for i, (op, mode) in enumerate(slots):
        # An even share of what is left: a slow operation (generation) cannot starve the rest.
        share = (deadline - time.monotonic()) / (len(slots) - i)
        _fuzz_operation(op, mode, server.url, config, report, time.monotonic() + max(share, 0.5))


def _fuzz_operation(
    op: Any, mode: Any, url: str, config: FuzzConfig, report: FuzzReport, deadline: float
) -> None:
    import hypothesis
    import hypothesis.errors
    import requests

    @hypothesis.settings(
        max_examples=config.max_examples,
        deadline=None,
        database=None,
        derandomize=config.derandomize,
        suppress_health_check=list(hypothesis.HealthCheck),
        phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
    )
    @hypothesis.seed(config.seed)
    @hypothesis.given(op.as_strategy(generation_mode=mode))
    def probe(case: Any) -> None:
        if time.monotonic() > deadline:
            return
        what = f"{op.method.upper()} {op.path} ({mode.value})"
        report.schema_requests += 1
        try:
            response = case.call(base_url=url, timeout=config.request_timeout_s)
        except requests.Timeout:
            report.hangs.append(f"{what}: {case.as_curl_command(base_url=url)}")
            return
        report.statuses[response.status_code] += 1
        if response.status_code >= 500:
            body = response.text[:300]
            curl = case.as_curl_command(base_url=url)
            report.server_errors.append(f"{what} -> {response.status_code} {body} | {curl}")

    # Unsatisfiable: nothing to generate in this mode (a negative case of a route without input).
    with contextlib.suppress(hypothesis.errors.Unsatisfiable):
        probe()


# -- hand-made -----------------------------------------------------------------------------------


def _routes(http: httpx.Client) -> list[tuple[str, str]]:
    paths = http.get("/openapi.json").json()["paths"]
    routes = [(m.upper(), p) for p, ops in paths.items() for m in ops]
    return sorted(routes, key=lambda r: r[0] == "DELETE")  # deletes last


def _send(
    http: httpx.Client, report: FuzzReport, method: str, path: str, content: bytes | None = None
) -> None:
    headers = {"Content-Type": "application/json"} if content is not None else {}
    what = f"{method} {path} {(content or b'')[:120]!r}"
    report.handmade_requests += 1
    for attempt in (1, 2):
        try:
            r = http.request(method, path, content=content, headers=headers)
            break
        except httpx.TimeoutException:
            report.hangs.append(what)
            return
        except httpx.TransportError as exc:
            # After a 500 the server closes the kept-alive connection (a finding of its own,
            # already counted): one retry on a fresh one. Twice is no answer at all.
            if attempt == 2:
                report.server_errors.append(f"{what} -> connection dropped ({exc})")
                return
    report.statuses[r.status_code] += 1
    if r.status_code >= 500:
        report.server_errors.append(f"{what} -> {r.status_code} {r.text[:300]}")


def _handmade(http: httpx.Client, server: ServerProcess, report: FuzzReport) -> None:
    for method, template in _routes(http):
        http.post("/v1/sessions", json={"id": SID})  # (again, after a delete)
        path = template.replace("{session_id}", SID)
        if method in ("POST", "PUT", "PATCH"):
            for raw in MALFORMED:
                _send(http, report, method, path, raw)
            for raw in _numeric_bodies(BASE_BODIES.get(template, {})):
                _send(http, report, method, path, raw)
        for query in _numeric_queries():
            _send(http, report, method, f"{path}?{query}", b"{}" if method == "POST" else None)


def _numeric_bodies(base: dict[str, Any]) -> Iterator[bytes]:
    """base with each numeric field set to each raw value, and logit_bias abused."""
    head = json.dumps(base)[:-1]
    sep = ", " if base else ""
    for name in NUMERIC_FIELDS:
        for value in VALUES:
            yield f'{head}{sep}"{name}": {value}}}'.encode()
    for value in VALUES:
        yield f'{head}{sep}"logit_bias": {{"1": {value}}}}}'.encode()
    for token in ("-1", "49152", "99999999999999999999", "1.5", "NaN", ""):
        yield f'{head}{sep}"logit_bias": {{"{token}": 5}}}}'.encode()


def _numeric_queries() -> Iterator[str]:
    for name in ("offset", "limit"):
        for value in ("-1", "0", "1.5", "1" + "0" * 40, "NaN", "inf", "", "x"):
            yield f"{name}={value}"


def _websocket(server: ServerProcess, report: FuzzReport) -> None:
    """Each numeric abuse and each malformed body as a message frame: an error frame or a
    reply, never an internal error nor a dropped connection; at the end a ping gets its pong."""
    frames = [*_numeric_bodies(BASE_BODIES["/v1/sessions/{session_id}/messages"]), *MALFORMED]
    with http_client(server.url) as http:
        http.post("/v1/sessions", json={"id": SID})
    url = f"{server.ws_url}/v1/sessions/{SID}/ws"
    ws = None
    try:
        for raw in [*frames, b'{"type": "ping"}']:
            if ws is None:
                ws = connect(url, proxy=None, open_timeout=30, close_timeout=2)
                ws.recv(timeout=30)  # ready
            text = raw.decode("utf-8", "replace")
            frame = text[:-1] + ', "type": "message"}' if text.endswith("}") else text
            if raw == b'{"type": "ping"}':
                frame = text
            report.handmade_requests += 1
            try:
                ws.send(frame)
                answer = _ws_answer(ws)
            except ConnectionClosed as exc:
                code = exc.rcvd.code if exc.rcvd is not None else None
                report.server_errors.append(f"WS {frame[:120]!r} -> connection closed ({code})")
                ws = None
                continue
            if answer is None:
                report.hangs.append(f"WS {frame[:120]!r}")
            elif answer["type"] == "error" and answer["error"].get("code") in INTERNAL:
                report.server_errors.append(f"WS {frame[:120]!r} -> {answer}")
    finally:
        if ws is not None:
            ws.close()


def _ws_answer(ws: Any, timeout_s: float = 30.0) -> dict[str, Any] | None:
    """The frame that ends the exchange (done, error, pong); None on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            frame = json.loads(ws.recv(timeout=max(0.1, deadline - time.monotonic())))
        except TimeoutError:
            return None
        if frame["type"] in ("done", "error", "pong", "cancelled"):
            return frame
    return None
