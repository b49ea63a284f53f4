"""Clients of a chaos scenario and their books: turns posted (which were acknowledged: a 200 with
its body, or an SSE `done`) and what the server kept of them.

A turn the client saw acknowledged must be in the session's history, in order, with the reply
the client saw; a turn refused with a definite store error (507) must not be.
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.chaos.harness import http_client


@dataclass
class TurnOutcome:
    session_id: str
    content: str
    status: int  # HTTP status; 0 when the connection failed (the server died, a timeout)
    reply: str | None = None  # set only when acknowledged
    code: str | None = None  # the error's code, or the transport error's name
    cached_tokens: int = 0
    started: float = 0.0  # time.monotonic() when it was posted
    latency_s: float = 0.0

    @property
    def acked(self) -> bool:
        return self.reply is not None

    @property
    def refused(self) -> bool:
        """The server said no (an HTTP error, or an SSE error event): nothing was kept."""
        return not self.acked and self.status != 0


def sse_events(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: ") :])


def error_code(response: httpx.Response) -> str | None:
    try:
        return response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def post_turn(
    http: httpx.Client, sid: str, content: str, stream: bool = False, **sampling: Any
) -> TurnOutcome:
    """One session turn, JSON or SSE; transport errors become status 0, never an exception."""
    out = TurnOutcome(sid, content, 0, started=time.monotonic())
    body = {"content": content, "stream": stream, **sampling}
    t0 = time.perf_counter()
    try:
        if stream:
            _stream_turn(http, body, out)
        else:
            response = http.post(f"/v1/sessions/{sid}/messages", json=body)
            out.status = response.status_code
            if response.status_code == 200:
                acknowledge(out, response.json())
            else:
                out.code = error_code(response)
    except (httpx.HTTPError, ValueError) as exc:
        out.reply, out.code = None, type(exc).__name__
    out.latency_s = time.perf_counter() - t0
    return out


def _stream_turn(http: httpx.Client, body: dict[str, Any], out: TurnOutcome) -> None:
    with http.stream("POST", f"/v1/sessions/{out.session_id}/messages", json=body) as response:
        out.status = response.status_code
        if response.status_code != 200:
            response.read()
            out.code = error_code(response)
            return
        for event in sse_events(response.iter_lines()):
            if event.get("type") == "done":
                acknowledge(out, event)
            elif "error" in event:
                out.code = event["error"].get("code") or "error"


def acknowledge(out: TurnOutcome, body: dict[str, Any]) -> None:
    out.reply = body["message"]["content"]
    out.cached_tokens = body["usage"]["prompt_tokens_details"]["cached_tokens"]


class Ledger:
    """Every turn posted, by every thread, in the order each session posted them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.outcomes: list[TurnOutcome] = []

    def add(self, outcome: TurnOutcome) -> TurnOutcome:
        with self._lock:
            self.outcomes.append(outcome)
        return outcome

    def of(self, sid: str) -> list[TurnOutcome]:
        with self._lock:
            return [o for o in self.outcomes if o.session_id == sid]

    def codes(self) -> dict[str, int]:
        counts: dict[str, int] = defaultdict(int)
        with self._lock:
            for o in self.outcomes:
                counts["acked" if o.acked else f"{o.status}:{o.code}"] += 1
        return dict(counts)

    @property
    def acked(self) -> int:
        with self._lock:
            return sum(o.acked for o in self.outcomes)


@dataclass
class HistoryCheck:
    acked: int = 0
    lost: list[str] = field(default_factory=list)  # acked, missing or out of order
    wrong: list[str] = field(default_factory=list)  # acked, stored with another reply
    phantom: list[str] = field(default_factory=list)  # stored, never sent (or stored twice)
    resurrected: list[str] = field(default_factory=list)  # refused store_full, stored anyway

    def merge(self, other: HistoryCheck) -> None:
        self.acked += other.acked
        for name in ("lost", "wrong", "phantom", "resurrected"):
            getattr(self, name).extend(getattr(other, name))


def check_history(messages: list[dict[str, Any]], outcomes: list[TurnOutcome]) -> HistoryCheck:
    """The stored messages of one session against the turns its client posted."""
    stored: list[tuple[str, str | None]] = []
    for i, m in enumerate(messages):
        if m["role"] == "user":
            after = messages[i + 1] if i + 1 < len(messages) else {}
            reply = after["content"] if after.get("role") == "assistant" else None
            stored.append((m["content"], reply))
    position = {user: i for i, (user, _) in reversed(list(enumerate(stored)))}
    sent = {o.content for o in outcomes}
    check = HistoryCheck(phantom=[u for u, _ in stored if u not in sent])
    seen: set[str] = set()
    for user, _ in stored:
        if user in seen:
            check.phantom.append(user)
        seen.add(user)
    last = -1
    for o in outcomes:
        if o.acked:
            check.acked += 1
            at = position.get(o.content)
            if at is None or at < last:
                check.lost.append(o.content)
                continue
            last = at
            if stored[at][1] != o.reply:
                check.wrong.append(f"{o.content!r}: acked {o.reply!r}, stored {stored[at][1]!r}")
        elif o.code == "store_full" and o.content in position:
            check.resurrected.append(o.content)
    return check


class ChatLoad:
    """One client thread per session posting turns until stopped, JSON and SSE alternating,
    greedy; a refused turn is retried after pause_s, a dead connection (the server is gone)
    ends its thread. Every turn goes to the ledger."""

    def __init__(
        self, url: str, sids: list[str], ledger: Ledger, tag: str = "", max_tokens: int = 6
    ) -> None:
        self.url, self.ledger, self.tag, self.max_tokens = url, ledger, tag, max_tokens
        self.pause_s = 0.1
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._chat, args=(sid,)) for sid in sids]

    def start(self) -> ChatLoad:
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop posting; returns once every client's last turn has ended."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout_s)
            if t.is_alive():
                raise TimeoutError(f"a client's turn did not end within {timeout_s} s")

    def _chat(self, sid: str) -> None:
        with http_client(self.url, 60) as http:
            turn = 0
            while not self._stop.is_set():
                content = f"[{sid} {self.tag}t{turn}] Name a colour."
                sse = turn % 2 == 1
                out = post_turn(http, sid, content, sse, max_tokens=self.max_tokens, temperature=0)
                self.ledger.add(out)
                turn += 1
                if out.status == 0:
                    return
                if not out.acked:
                    self._stop.wait(self.pause_s)
