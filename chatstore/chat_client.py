"""A client of the sessions API: HTTP for sessions, the WebSocket for streamed turns.

    client = ChatClient("http://127.0.0.1:8000", api_key=None)
    session = client.create_session(system_prompt="Be brief.")
    with client.connect(session.id) as sock:
        for event in sock.send("Hi!", max_tokens=32):
            ...  # Delta(text) ... then one Reply(text, stats)

Every failure (server down, 401, 404, an error frame, a dropped socket) is a ChatError carrying
the HTTP status and the server's error code where there is one, never a library exception.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.protocol import State
from websockets.sync.client import ClientConnection, connect

TIERS = ("device", "dram", "ssd", "remote")
CANCEL_WAIT_S = 10.0  # how long a cancel waits for the server's confirmation
ADMIN_PAGES = 5  # /stats looks this far (100 sessions a page) through the admin table


class ChatError(Exception):
    """A failure the user can act on; `status` is the HTTP status (None: no answer at all)."""

    def __init__(self, message: str, status: int | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code

    def __str__(self) -> str:
        return self.message if self.status is None else f"{self.status}: {self.message}"


@dataclass(frozen=True)
class SessionSummary:
    id: str
    num_messages: int
    num_tokens: int
    kv_location: str | None
    updated_at: float

    @property
    def turns(self) -> int:
        # A turn stores two messages; an optional system prompt adds one, which // 2 drops.
        return self.num_messages // 2


@dataclass(frozen=True)
class SessionDetail:
    summary: SessionSummary
    turns: int
    kv_bytes: int | None  # None: this server does not report it


@dataclass(frozen=True)
class KVFootprint:
    """Where a session's stored KV is, in bytes per tier (device blocks are not counted)."""

    kv_bytes: int
    bytes_by_tier: dict[str, int]


@dataclass(frozen=True)
class ReplyStats:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_by_tier: dict[str, int]
    ttft_ms: float | None
    total_ms: float | None
    finish_reason: str | None

    @property
    def tokens_per_s(self) -> float | None:
        """Decode rate: the tokens after the first over the time after the first."""
        if self.ttft_ms is None or self.total_ms is None or self.completion_tokens < 2:
            return None
        decode_s = (self.total_ms - self.ttft_ms) / 1000
        return (self.completion_tokens - 1) / decode_s if decode_s > 0 else None


@dataclass(frozen=True)
class Delta:
    text: str


@dataclass(frozen=True)
class Reply:
    text: str
    stats: ReplyStats


@dataclass
class ClientOptions:
    url: str = "http://127.0.0.1:8000"
    api_key: str | None = None
    timeout_s: float = 30.0  # HTTP calls and the WebSocket handshake
    turn_timeout_s: float = 600.0  # the longest wait for the next frame of a turn
    sampling: dict[str, object] = field(default_factory=dict)  # max_tokens, temperature...


def summary_of(body: dict[str, Any]) -> SessionSummary:
    return SessionSummary(
        id=body["id"],
        num_messages=int(body.get("num_messages") or 0),
        num_tokens=int(body.get("num_tokens") or 0),
        kv_location=body.get("kv_location"),
        updated_at=float(body.get("updated_at") or 0.0),
    )


def footprint_of(row: dict[str, Any]) -> KVFootprint:
    by_tier = {str(k): int(v) for k, v in (row.get("kv_bytes_by_tier") or {}).items() if v}
    return KVFootprint(int(row.get("kv_bytes") or 0), by_tier)


def stats_of(done: dict[str, Any]) -> ReplyStats:
    usage = done.get("usage") or {}
    timings = done.get("timings") or {}
    by_tier = usage.get("cached_tokens_by_tier") or {}
    return ReplyStats(
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
        cached_by_tier={tier: int(by_tier.get(tier) or 0) for tier in TIERS},
        ttft_ms=timings.get("ttft_ms"),
        total_ms=timings.get("total_ms"),
        finish_reason=done.get("finish_reason"),
    )


def error_of(body: object, status: int | None, fallback: str) -> ChatError:
    """The server's OpenAI-shaped {"error": {"message", "code"}} as a ChatError."""
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and err.get("message"):
        return ChatError(str(err["message"]), status, err.get("code"))
    return ChatError(fallback, status)


class ChatClient:
    def __init__(self, options: ClientOptions) -> None:
        self.options = options
        self.url = options.url.rstrip("/")
        headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
        # trust_env=False: a loopback server must not be reached through an HTTP proxy.
        self._http = httpx.Client(
            base_url=self.url, headers=headers, timeout=options.timeout_s, trust_env=False
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ChatClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, **kw: Any) -> Any:
        try:
            response = self._http.request(method, path, **kw)
        except httpx.TimeoutException as exc:
            raise ChatError(f"the server at {self.url} did not answer in time ({exc})") from None
        except httpx.HTTPError as exc:
            raise ChatError(f"cannot reach the server at {self.url}: {exc}") from None
        try:
            body = response.json()
        except ValueError:
            body = None
        if response.status_code >= 400:
            raise error_of(body, response.status_code, response.reason_phrase or "error")
        return body

    def create_session(self, system_prompt: str | None = None) -> SessionSummary:
        body = {"system_prompt": system_prompt} if system_prompt else {}
        return summary_of(self._request("POST", "/v1/sessions", json=body))

    def list_sessions(self, limit: int = 100) -> list[SessionSummary]:
        body = self._request("GET", "/v1/sessions", params={"limit": limit})
        return [summary_of(s) for s in body.get("data", [])]

    def get_session(self, session_id: str) -> SessionDetail:
        body = self._request("GET", f"/v1/sessions/{quote(session_id, safe='')}")
        messages = body.get("messages") or []
        kv_bytes = body.get("kv_bytes")
        return SessionDetail(
            summary=summary_of(body),
            turns=sum(1 for m in messages if m.get("role") == "user"),
            kv_bytes=int(kv_bytes) if kv_bytes is not None else None,
        )

    def kv_footprint(self, session_id: str) -> KVFootprint | None:
        """The session's stored KV from the admin session table, where this server has one and
        this key may read it (local mode, the admin key); None otherwise: a tenant key's
        401/403 is not an error here."""
        offset: int | None = 0
        for _ in range(ADMIN_PAGES):
            try:
                params = {"offset": offset, "limit": 100}
                body = self._request("GET", "/admin/cache/sessions", params=params)
            except ChatError:
                return None
            for row in body.get("data") or []:
                if row.get("id") == session_id:
                    return footprint_of(row)
            offset = body.get("next_offset")
            if not body.get("has_more") or offset is None:
                return None
        return None

    def connect(self, session_id: str) -> SessionSocket:
        return SessionSocket.open(self, session_id)

    def ws_url(self, session_id: str) -> str:
        scheme, rest = self.url.split("://", 1)
        ws_scheme = "wss" if scheme == "https" else "ws"
        return f"{ws_scheme}://{rest}/v1/sessions/{quote(session_id, safe='')}/ws"


class SessionSocket:
    """One session's WebSocket: turns stream over it one at a time."""

    def __init__(self, ws: ClientConnection, session_id: str, timeout_s: float) -> None:
        self.ws = ws
        self.session_id = session_id
        self.timeout_s = timeout_s

    @classmethod
    def open(cls, client: ChatClient, session_id: str) -> SessionSocket:
        key = client.options.api_key
        headers = {"Authorization": f"Bearer {key}"} if key else None
        url, timeout = client.ws_url(session_id), client.options.timeout_s
        try:
            ws = connect(url, additional_headers=headers, open_timeout=timeout, proxy=None)
        except InvalidStatus as exc:
            status = exc.response.status_code
            raise ChatError(f"WebSocket refused: {exc.response.reason_phrase}", status) from None
        except (OSError, InvalidHandshake, TimeoutError) as exc:
            raise ChatError(f"cannot reach the server at {client.url}: {exc}") from None
        sock = cls(ws, session_id, client.options.turn_timeout_s)
        first = sock._recv()
        if first.get("type") != "ready":  # the server sends the error, then closes with 4xxx
            with contextlib.suppress(ConnectionClosed, TimeoutError):
                ws.recv(timeout=timeout)
            sock.close()
            raise sock._frame_error(first)
        return sock

    def close(self) -> None:
        self.ws.close()

    def __enter__(self) -> SessionSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def typing(self) -> None:
        """Hint that a message is coming: the server moves the session's KV up meanwhile."""
        self._send({"type": "typing"})

    def send(self, content: str, **sampling: object) -> Generator[Delta | Reply, None, None]:
        """Start a turn; yields its text deltas, then the Reply. Closing the iterator early
        (Ctrl-C in the caller) cancels the turn on the server."""
        fields = {k: v for k, v in sampling.items() if v is not None}
        self._send({"type": "message", "content": content, **fields})
        text: list[str] = []
        finished = False
        try:
            while True:
                frame = self._recv()
                kind = frame.get("type")
                if kind == "delta" and frame.get("index", 0) == 0:
                    text.append(frame["text"])
                    yield Delta(frame["text"])
                elif kind == "done":
                    finished = True
                    yield Reply("".join(text), stats_of(frame))
                    return
                elif kind in ("error", "cancelled"):
                    finished = True
                    raise self._frame_error(frame)
        finally:
            if not finished:
                self.cancel()

    @property
    def is_open(self) -> bool:
        return self.ws.state is State.OPEN

    def cancel(self) -> None:
        """Abort the running turn and wait for the server to say so (its blocks are freed)."""
        try:
            self._send({"type": "cancel"})
            while self._recv(CANCEL_WAIT_S).get("type") not in ("cancelled", "done", "error"):
                pass
        except ChatError:
            pass  # the socket is gone: the server aborts the turn on its own

    def _send(self, frame: dict[str, object]) -> None:
        try:
            self.ws.send(json.dumps(frame))
        except ConnectionClosed as exc:
            raise ChatError(f"connection to the server lost ({exc})") from None

    def _recv(self, timeout_s: float | None = None) -> dict[str, Any]:
        timeout_s = timeout_s or self.timeout_s
        try:
            raw = self.ws.recv(timeout=timeout_s)
        except TimeoutError:
            raise ChatError(f"no answer from the server in {timeout_s:g} s") from None
        except ConnectionClosed as exc:
            raise ChatError(f"connection to the server lost ({exc})") from None
        try:
            frame = json.loads(raw)
        except ValueError:
            raise ChatError(f"the server sent a frame that is not JSON: {raw[:80]!r}") from None
        return frame if isinstance(frame, dict) else {}

    def _frame_error(self, frame: dict[str, Any]) -> ChatError:
        if frame.get("type") == "cancelled":
            return ChatError("turn cancelled", code="cancelled")
        close_code = self.ws.close_code or 0
        status = close_code - 4000 if 4000 <= close_code < 5000 else None
        return error_of(frame, status, f"unexpected frame {frame.get('type')!r}")
