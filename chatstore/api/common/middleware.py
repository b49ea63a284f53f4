"""Pure-ASGI middleware (it must not buffer streams nor swallow disconnects):

* applies the browser policy (origin_policy.py): Host check in local mode, CORS, cross-origin
  refusals and the JSON content type, for WebSocket upgrades too;
* stamps the arrival time, for TTFT;
* caps request bodies (413 before the app sees them) and refuses new work while draining (503);
* asks for the admin key on /metrics when `metrics_auth` is set;
* logs one JSON line per request (session, tokens, cached tokens, TTFT) and counts it. The line
  holds the path without its query string, so a `?api_key=` never reaches it.
"""

from __future__ import annotations

import json
import logging
import time

from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chatstore.api.chat.turn import Turn
from chatstore.api.common.auth import guard_metrics
from chatstore.api.common.errors import APIError
from chatstore.api.common.origin_policy import Headers, Incoming, policy_for

access_log = logging.getLogger("chatstore.access")
OPEN_PATHS = ("/healthz", "/readyz", "/metrics")
POLICY_VIOLATION = 1008  # WebSocket close code, for servers that cannot answer with a 403


class BodyTooLarge(Exception):
    pass


class APIMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            return await self._websocket(scope, receive, send)
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        scope["chatstore.started"] = started
        status = {"code": 0}
        incoming = Incoming.from_scope(scope)
        policy = policy_for(scope["app"].state.settings)
        cors = policy.cors_headers(incoming)

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                if cors:
                    message = {**message, "headers": [*message.get("headers", ()), *cors]}
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                self._log(scope, status["code"], started)

        refusal = policy.refusal(incoming) or self._refusal(scope)
        if refusal is not None:
            return await self._reply(refusal, send_wrapper)
        if incoming.is_preflight:
            return await _preflight(policy.preflight_headers(incoming), send_wrapper)
        try:
            receive = await self._buffered(scope, receive)
        except BodyTooLarge:
            err = APIError(413, f"request body over {self.max_body_bytes} bytes", code="too_large")
            return await self._reply(err, send_wrapper)
        await self.app(scope, receive, send_wrapper)

    def _refusal(self, scope: Scope) -> APIError | None:
        app = scope["app"]
        service = getattr(app.state, "service", None)
        if service is not None and service.draining and scope["path"] not in OPEN_PATHS:
            retry = {"Retry-After": str(app.state.settings.retry_after_s)}
            return APIError(503, "server is shutting down", code="draining", headers=retry)
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    too_big = int(value) > self.max_body_bytes
                except ValueError:
                    return APIError(400, "bad Content-Length", code="bad_request")
                if too_big:
                    return APIError(
                        413, f"request body over {self.max_body_bytes} bytes", code="too_large"
                    )
        if scope["path"] == "/metrics":
            try:
                guard_metrics(HTTPConnection(scope))
            except APIError as exc:
                return exc
        return None

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Refuse a foreign Host or Origin before the handshake completes: browsers apply no
        CORS to WebSockets, so this is all that stops another site's page from connecting."""
        refusal = policy_for(scope["app"].state.settings).refusal(Incoming.from_scope(scope))
        if refusal is None:
            return await self.app(scope, receive, send)
        await receive()  # websocket.connect, which the refusal answers
        if "websocket.http.response" in scope.get("extensions", {}):
            head, body = _error_message(refusal)
            start = {"type": "websocket.http.response.start", "status": refusal.status}
            await send({**start, "headers": head})
            return await send({"type": "websocket.http.response.body", "body": body})
        await send({"type": "websocket.close", "code": POLICY_VIOLATION})

    async def _buffered(self, scope: Scope, receive: Receive) -> Receive:
        """Read the whole (small) body now, so an oversized one is refused before parsing."""
        if scope["method"] in ("GET", "HEAD", "DELETE", "OPTIONS"):
            return receive
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return _replay([message], receive)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                raise BodyTooLarge
            if not message.get("more_body"):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        return _replay([body], receive)

    async def _reply(self, err: APIError, send: Send) -> None:
        headers, body = _error_message(err)
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _log(self, scope: Scope, status: int, started: float) -> None:
        elapsed = time.perf_counter() - started
        turn = scope.get("chatstore.turn")
        metrics = getattr(scope["app"].state, "metrics", None)
        route = scope.get("route")
        path = getattr(route, "path", None) or "unmatched"
        if metrics is not None:
            metrics.observe_request(scope["method"], path, status, elapsed)
        if scope["path"] in OPEN_PATHS and status < 400:
            return
        line: dict[str, object] = {
            "event": "request",
            "method": scope["method"],
            "path": scope["path"],
            "status": status,
            "latency_ms": round(elapsed * 1000, 2),
        }
        if turn is not None:
            line.update(turn_fields(turn))
        access_log.info(json.dumps(line, separators=(",", ":")))


def turn_fields(turn: Turn) -> dict[str, object]:
    fields: dict[str, object] = {
        "request_id": turn.request_id,
        "tenant": turn.request.tenant,
        "session": turn.session_id,
    }
    result = turn.result
    if result is not None:
        fields.update(
            prompt_tokens=result.usage.prompt_tokens,
            cached_tokens=result.usage.cached_tokens,
            completion_tokens=result.usage.completion_tokens,
            ttft_ms=None if result.ttft_s is None else round(result.ttft_s * 1000, 2),
            finish=result.finish_reasons[0] if result.finish_reasons else None,
        )
    return fields


def _error_message(err: APIError) -> tuple[Headers, bytes]:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    return headers, body


async def _preflight(headers: Headers, send: Send) -> None:
    start = {"type": "http.response.start", "status": 204}
    await send({**start, "headers": [*headers, (b"content-length", b"0")]})
    await send({"type": "http.response.body", "body": b""})


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay
