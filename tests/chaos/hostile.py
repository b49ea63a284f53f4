"""Slow and hostile clients: many concurrent streams, SSE and WebSocket mixed, among them clients
that never read (a raw socket with a tiny receive buffer; a WebSocket nobody reads), clients that
disconnect mid-stream, WebSocket frames over max_body_bytes and 1 MiB request bodies.

    /healthz, sampled every 20 ms from a thread of its own, stays fast throughout (p99)
    every well-behaved stream ends with `done`; oversized input gets 413 / 400 / an error frame
    afterwards every KV block is back in the pool (waited for, bounded)
    the server's RSS after a measured round is within a few % of its RSS after a warm-up round
"""

from __future__ import annotations

import contextlib
import json
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from tests.chaos.clients import error_code, post_turn, sse_events
from tests.chaos.harness import ServerProcess, http_client
from tests.chaos.probes import LatencySampler, wait_idle

MAX_BODY = 1 << 20
# Of every 16 streams: what each client does.
MIX = (
    *("sse", "ws", "sse", "ws", "sse", "ws", "sse", "ws"),
    *("sse_stall", "ws_stall", "sse_drop", "ws_drop", "sse", "ws", "sse_drop", "sse_stall"),
)
HOSTILE = ("huge_body", "long_message", "ws_huge_frame", "bad_json")  # one of each per 16


@dataclass
class HostileConfig:
    streams: int = 64
    rounds: int = 1  # measured rounds, after one warm-up round
    max_tokens: int = 24
    idle_timeout_s: float = 60.0
    seed: int = 7


@dataclass
class HostileReport:
    streams: int = 0
    outcomes: Counter = field(default_factory=Counter)  # "kind:result" -> count
    unexpected: list[str] = field(default_factory=list)  # a kind that did not get its answer
    healthz_p99_ms: float = 0.0
    healthz_max_ms: float = 0.0
    healthz_failures: int = 0
    healthz_samples: int = 0
    leaked_blocks: int | None = None  # num_blocks - free_blocks once idle (None: never idle)
    rss_start: int = 0  # after the warm-up round
    rss_end: int = 0
    anon_start: int = 0  # RssAnon, the heap alone
    anon_end: int = 0
    seconds: float = 0.0

    @property
    def rss_growth_pct(self) -> float:
        return 100.0 * (self.rss_end - self.rss_start) / self.rss_start if self.rss_start else 0.0


def run(work: Path, config: HostileConfig, say: Callable[[str], None] = print) -> HostileReport:
    t0 = time.monotonic()
    report = HostileReport(streams=config.streams)
    env = {
        # DRAM small enough that the warm-up round touches all of it, and no LMDB KV tier (its
        # mapped pages count in RSS as the file grows): what RSS may grow by is then a leak.
        "CHATSTORE_DRAM_BYTES": str(64 << 20),
        "CHATSTORE_SSD_BYTES": "0",
        "CHATSTORE_KV_CACHE_BYTES": str(128 << 20),
        "CHATSTORE_MAX_TURNS_PER_TENANT": str(4 * config.streams),
        "CHATSTORE_MAX_BODY_BYTES": str(MAX_BODY),
    }
    rng = random.Random(config.seed)
    with ServerProcess(work / "data", env) as server:
        _round(server, config, rng, HostileReport())  # warm-up: allocator and pool high-water
        with server.client(30) as http:
            wait_idle(http, config.idle_timeout_s)
        report.rss_start, report.anon_start = server.rss(), server.rss("RssAnon")
        sampler = LatencySampler(server.url).start()
        try:
            for i in range(config.rounds):
                _round(server, config, rng, report)
                say(f"  round {i}: {dict(report.outcomes)}")
        finally:
            sampler.stop()
        with server.client(30) as http:
            try:
                stats = wait_idle(http, config.idle_timeout_s)
                report.leaked_blocks = stats["num_blocks"] - stats["free_blocks"]
            except TimeoutError as exc:
                say(f"  {exc}")
        report.rss_end, report.anon_end = server.rss(), server.rss("RssAnon")
        report.healthz_p99_ms = sampler.p99()
        report.healthz_max_ms = max(sampler.ms(), default=0.0)
        report.healthz_failures = sampler.failures()
        report.healthz_samples = len(sampler.samples)
    report.seconds = time.monotonic() - t0
    return report


def _round(
    server: ServerProcess, config: HostileConfig, rng: random.Random, report: HostileReport
) -> None:
    """One wave of clients at once; stalled sockets stay open until every other client is done,
    then close (the engine must have ended or aborted their turns by then, or does now)."""
    kinds = [MIX[i % len(MIX)] for i in range(config.streams)]
    kinds += [HOSTILE[i % len(HOSTILE)] for i in range(max(1, config.streams // 16) * 4)]
    rng.shuffle(kinds)
    with server.client(30) as http:
        sids = [http.post("/v1/sessions", json={}).json()["id"] for _ in kinds]
    stalled: list[Any] = []
    lock = threading.Lock()

    def client(kind: str, sid: str) -> None:
        try:
            result, held = CLIENTS[kind](server, sid, config.max_tokens)
        except Exception as exc:  # a client's own failure is a finding, not a crash of the run
            result, held = f"exception {type(exc).__name__}: {exc}", None
        with lock:
            report.outcomes[f"{kind}:{result}"] += 1
            if result not in EXPECTED[kind]:
                report.unexpected.append(f"{kind} on {sid}: {result}")
            if held is not None:
                stalled.append(held)

    threads = [threading.Thread(target=client, args=kv) for kv in zip(kinds, sids, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
        if t.is_alive():
            report.unexpected.append("a client thread hung")
    for held in stalled:
        with contextlib.suppress(Exception):
            held.close()
    with server.client(30) as http:
        for sid in sids:
            http.delete(f"/v1/sessions/{sid}")  # the next round starts from the same DRAM


def _body(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"content": "Tell me about the sea.", "max_tokens": max_tokens, **extra}


def _sse(server: ServerProcess, sid: str, max_tokens: int) -> tuple[str, None]:
    with http_client(server.url, 120) as http:
        out = post_turn(http, sid, "Tell me about the sea.", True, max_tokens=max_tokens)
    return ("done" if out.acked else f"{out.status} {out.code}"), None


def _sse_drop(server: ServerProcess, sid: str, max_tokens: int) -> tuple[str, None]:
    """Read two deltas, then hang up."""
    with http_client(server.url, 120) as http:
        body = _body(max(max_tokens, 64), stream=True, ignore_eos=True)
        with http.stream("POST", f"/v1/sessions/{sid}/messages", json=body) as response:
            seen = 0
            for event in sse_events(response.iter_lines()):
                seen += event.get("type") == "delta"
                if seen >= 2:
                    return "dropped", None
    return "ended before two deltas", None


def _sse_stall(server: ServerProcess, sid: str, max_tokens: int) -> tuple[str, socket.socket]:
    """Send the request on a socket with a tiny receive buffer, then never read."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", server.port))
    body = json.dumps(_body(max(max_tokens, 128), stream=True, ignore_eos=True)).encode()
    head = (
        f"POST /v1/sessions/{sid}/messages HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return "stalled", sock


def _ws(server: ServerProcess, sid: str) -> ClientConnection:
    ws = connect(
        f"{server.ws_url}/v1/sessions/{sid}/ws",
        proxy=None,
        open_timeout=30,
        close_timeout=2,
        compression=None,  # an oversized frame must be oversized on the wire
    )
    assert json.loads(ws.recv(timeout=30))["type"] == "ready"
    return ws


def _ws_turn(server: ServerProcess, sid: str, max_tokens: int) -> tuple[str, None]:
    with _ws(server, sid) as ws:
        ws.send(json.dumps({"type": "message", **_body(max_tokens)}))
        while True:
            frame = json.loads(ws.recv(timeout=120))
            if frame["type"] == "done":
                return "done", None
            if frame["type"] == "error":
                return f"error {frame['error'].get('code')}", None


def _ws_drop(server: ServerProcess, sid: str, max_tokens: int) -> tuple[str, None]:
    with _ws(server, sid) as ws:
        ws.send(json.dumps({"type": "message", **_body(max(max_tokens, 64), ignore_eos=True)}))
        seen = 0
        while seen < 2:
            seen += json.loads(ws.recv(timeout=120))["type"] == "delta"
    return "dropped", None


def _ws_stall(server: ServerProcess, sid: str, max_tokens: int) -> tuple[str, ClientConnection]:
    ws = _ws(server, sid)
    ws.send(json.dumps({"type": "message", **_body(max(max_tokens, 128), ignore_eos=True)}))
    return "stalled", ws  # never read: its queue fills, then its socket's window closes


def _ws_huge_frame(server: ServerProcess, sid: str, _: int) -> tuple[str, None]:
    """A frame over max_body_bytes: an error frame (413), or the socket closed with 1009."""
    with _ws(server, sid) as ws:
        try:
            ws.send(json.dumps({"type": "message", "content": "x" * (MAX_BODY + 1024)}))
            frame = json.loads(ws.recv(timeout=30))
        except ConnectionClosed as exc:
            code = exc.rcvd.code if exc.rcvd is not None else None
            return f"closed {code}", None
    return f"error {frame.get('error', {}).get('code')}", None


def _huge_body(server: ServerProcess, sid: str, _: int) -> tuple[str, None]:
    with http_client(server.url, 60) as http:
        r = http.post(f"/v1/sessions/{sid}/messages", json={"content": "x" * MAX_BODY})
    return f"{r.status_code} {error_code(r)}", None


def _long_message(server: ServerProcess, sid: str, _: int) -> tuple[str, None]:
    """Under the body cap, over max_message_chars."""
    with http_client(server.url, 60) as http:
        body = {"content": "word " * 60_000, "max_tokens": 4}
        r = http.post(f"/v1/sessions/{sid}/messages", json=body)
    return f"{r.status_code} {error_code(r)}", None


def _bad_json(server: ServerProcess, sid: str, _: int) -> tuple[str, None]:
    with http_client(server.url, 60) as http:
        headers = {"Content-Type": "application/json"}
        r = http.post(f"/v1/sessions/{sid}/messages", content=b'{"content": "x"', headers=headers)
    return f"{r.status_code} {error_code(r)}", None


CLIENTS: dict[str, Callable[[ServerProcess, str, int], tuple[str, Any]]] = {
    "sse": _sse,
    "ws": _ws_turn,
    "sse_drop": _sse_drop,
    "ws_drop": _ws_drop,
    "sse_stall": _sse_stall,
    "ws_stall": _ws_stall,
    "ws_huge_frame": _ws_huge_frame,
    "huge_body": _huge_body,
    "long_message": _long_message,
    "bad_json": _bad_json,
}
EXPECTED: dict[str, set[str]] = {
    "sse": {"done"},
    "ws": {"done"},
    "sse_drop": {"dropped"},
    "ws_drop": {"dropped"},
    "sse_stall": {"stalled"},
    "ws_stall": {"stalled"},
    "ws_huge_frame": {"error too_large", "closed 1009"},
    "huge_body": {"413 too_large"},
    "long_message": {"400 too_long"},
    "bad_json": {"400 invalid_json"},
}
