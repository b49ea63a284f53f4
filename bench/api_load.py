"""API load: N concurrent multi-turn clients streaming over SSE and over WebSocket.

The server runs as its own process (`chatstore serve` on a loopback port, real model, engine and
store); each client owns a session and keeps conversing for `--duration` seconds. Per turn it
records the TTFT it sees (request sent -> first token delta received) and the engine's own TTFT,
which the server reports in the turn's final event (Request created -> first token sampled).

    api_overhead    = client TTFT - engine TTFT, per turn (parse, auth, template, hand-over to
                      and from the engine thread, SSE/WebSocket framing, loopback both ways,
                      the client library)
    server_overhead = the server's own share: request arrival -> first token on the event loop,
                      minus the engine TTFT

Then, unless --no-engine-alone, the same number of concurrent turns is run straight against an
in-process AsyncEngine (no HTTP at all) for the TTFT of the engine alone. Intended 429s (queue
full) are retried after Retry-After and counted apart; anything else is an error. The last line
printed is one JSON object.

    python bench/api_load.py [--clients 8] [--duration 20] [--max-tokens 16] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx
import websockets

PROMPTS = (
    "Tell me about the moon.",
    "What is a good name for a cat?",
    "Give me one tip for writing.",
    "Why is the sky blue?",
)


@dataclass
class Stats:
    ttft: list[float] = field(default_factory=list)  # seconds, client side
    engine_ttft: list[float] = field(default_factory=list)
    overhead: list[float] = field(default_factory=list)
    server_overhead: list[float] = field(default_factory=list)  # as the server measures it
    turns: int = 0
    tokens: int = 0
    rejected: int = 0  # intended 429s
    errors: list[str] = field(default_factory=list)

    def add(self, ttft: float | None, done: dict) -> None:
        self.turns += 1
        self.tokens += done["usage"]["completion_tokens"]
        engine = done["timings"]["engine_ttft_ms"]
        if ttft is not None and engine is not None:
            self.ttft.append(ttft)
            self.engine_ttft.append(engine / 1000)
            self.overhead.append(ttft - engine / 1000)
            self.server_overhead.append((done["timings"]["ttft_ms"] - engine) / 1000)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- clients ------------------------------------------------------------------------------------


async def sse_client(http: httpx.AsyncClient, i: int, stop: float, args, stats: Stats) -> None:
    sid = (await http.post("/v1/sessions", json={"system_prompt": "Be brief."})).json()["id"]
    turn = 0
    while time.monotonic() < stop:
        body = {"content": PROMPTS[(i + turn) % len(PROMPTS)], "stream": True,
                "max_tokens": args.max_tokens, "temperature": 0}  # fmt: skip
        sent, first = time.perf_counter(), None
        async with http.stream("POST", f"/v1/sessions/{sid}/messages", json=body) as r:
            if r.status_code == 429:
                stats.rejected += 1
                await asyncio.sleep(float(r.headers.get("Retry-After", "1")))
                continue
            if r.status_code != 200:
                stats.errors.append(f"sse {r.status_code}: {(await r.aread())[:200]!r}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if event.get("type") == "delta" and first is None:
                    first = time.perf_counter() - sent
                elif event.get("type") == "done":
                    stats.add(first, event)
                elif "error" in event:
                    stats.errors.append(f"sse stream error: {event['error']}")
        turn += 1


async def ws_client(url: str, http: httpx.AsyncClient, i: int, stop: float, args, stats: Stats):
    sid = (await http.post("/v1/sessions", json={"system_prompt": "Be brief."})).json()["id"]
    async with websockets.connect(f"{url}/v1/sessions/{sid}/ws", proxy=None) as ws:
        json.loads(await ws.recv())  # ready
        turn = 0
        while time.monotonic() < stop:
            frame = {"type": "message", "content": PROMPTS[(i + turn) % len(PROMPTS)],
                     "max_tokens": args.max_tokens, "temperature": 0}  # fmt: skip
            sent, first = time.perf_counter(), None
            await ws.send(json.dumps(frame))
            while True:
                event = json.loads(await ws.recv())
                if event["type"] == "delta" and first is None:
                    first = time.perf_counter() - sent
                elif event["type"] == "done":
                    stats.add(first, event)
                    break
                elif event["type"] == "error":
                    if event["error"]["type"] == "rate_limit_error":
                        stats.rejected += 1
                        await asyncio.sleep(1)
                    else:
                        stats.errors.append(f"ws error: {event['error']}")
                    break
            turn += 1


async def drive(url: str, args, transport: str) -> tuple[Stats, float]:
    stats = Stats()
    limits = httpx.Limits(max_connections=args.clients * 2)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        start = time.monotonic()
        stop = start + args.duration
        if transport == "sse":
            jobs = [sse_client(http, i, stop, args, stats) for i in range(args.clients)]
        else:
            ws_url = url.replace("http://", "ws://")
            jobs = [ws_client(ws_url, http, i, stop, args, stats) for i in range(args.clients)]
        results = await asyncio.gather(*jobs, return_exceptions=True)
        stats.errors += [f"{type(r).__name__}: {r}" for r in results if isinstance(r, Exception)]
        return stats, time.monotonic() - start


# -- the server, and the engine alone --------------------------------------------------------


def start_server(args, data_dir: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {
        **os.environ,
        "CHATSTORE_DATA_DIR": data_dir,
        "CHATSTORE_API_KEYS": "",
        "CHATSTORE_ADMIN_KEY": "",
        "CHATSTORE_LOG_LEVEL": "warning",
    }
    cmd = [sys.executable, "-m", "chatstore", "serve", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise SystemExit("server did not become ready")


async def engine_alone(args, data_dir: str) -> list[float]:
    """TTFT of `clients` concurrent multi-turn conversations submitted straight to AsyncEngine."""
    from chatstore.api.backend import build_backend
    from chatstore.config import load_config
    from chatstore.engine.request import Request, SamplingParams

    backend = build_backend(load_config(overrides={"data_dir": data_dir}, env={}))
    engine, template = backend.engine, backend.template
    engine.start()
    ttfts: list[float] = []
    stop = time.monotonic() + args.duration

    async def client(i: int) -> None:
        history = [{"role": "system", "content": "Be brief."}]
        turn = 0
        while time.monotonic() < stop:
            history.append({"role": "user", "content": PROMPTS[(i + turn) % len(PROMPTS)]})
            sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0)
            request = Request(f"alone-{i}-{turn}", template.render(history), sampling,
                              session_id=f"alone-{i}")  # fmt: skip
            sent, first, text = time.perf_counter(), None, ""
            async for out in engine.submit(request):
                for sample in out.samples:
                    if first is None and sample.token_ids:
                        first = time.perf_counter() - sent
                    text += sample.text
            if first is not None:
                ttfts.append(first)
            history.append({"role": "assistant", "content": text})
            turn += 1

    await asyncio.gather(*(client(i) for i in range(args.clients)))
    await engine.shutdown()
    backend.store.close()
    return ttfts


# -- main -------------------------------------------------------------------------------------


def report(name: str, stats: Stats, elapsed: float) -> dict:
    row = {
        "transport": name,
        "turns": stats.turns,
        "requests_per_s": round(stats.turns / elapsed, 3),
        "tokens_per_s": round(stats.tokens / elapsed, 2),
        "ttft_ms_p50": pct(stats.ttft, 0.5),
        "ttft_ms_p99": pct(stats.ttft, 0.99),
        "engine_ttft_ms_p50": pct(stats.engine_ttft, 0.5),
        "api_overhead_ms_p50": pct(stats.overhead, 0.5),
        "api_overhead_ms_p99": pct(stats.overhead, 0.99),
        "server_overhead_ms_p50": pct(stats.server_overhead, 0.5),
        "rejected_429": stats.rejected,
        "errors": len(stats.errors),
    }
    shown = {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}
    print(" ".join(f"{k}={v}" for k, v in shown.items()), flush=True)
    for err in stats.errors[:5]:
        print(f"  error: {err}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per transport")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--transports", default="sse,ws")
    parser.add_argument("--no-engine-alone", action="store_true")
    parser.add_argument("--quick", action="store_true", help="4 clients, 8 s, 8 tokens")
    args = parser.parse_args()
    if args.quick:
        args.clients, args.duration, args.max_tokens = 4, 8.0, 8
    rows = []
    with tempfile.TemporaryDirectory(prefix="chatstore-bench-") as data_dir:
        proc, url = start_server(args, os.path.join(data_dir, "server"))
        try:
            for transport in args.transports.split(","):
                stats, elapsed = asyncio.run(drive(url, args, transport))
                rows.append(report(transport, stats, elapsed))
        finally:
            proc.terminate()
            proc.wait(60)
        alone = []
        if not args.no_engine_alone:
            alone = asyncio.run(engine_alone(args, os.path.join(data_dir, "alone")))
            print(f"engine alone: turns={len(alone)} ttft_ms_p50={pct(alone, 0.5):.2f} "
                  f"ttft_ms_p99={pct(alone, 0.99):.2f}")  # fmt: skip
    overheads = [r["api_overhead_ms_p50"] for r in rows if r["api_overhead_ms_p50"] is not None]
    http_ttft = [r["ttft_ms_p50"] for r in rows if r["ttft_ms_p50"] is not None]
    result = {
        "clients": args.clients,
        "duration_s": args.duration,
        "max_tokens": args.max_tokens,
        "transports": rows,
        "requests_per_s": round(sum(r["requests_per_s"] for r in rows) / max(len(rows), 1), 3),
        "ttft_ms_p50": max(http_ttft) if http_ttft else None,
        "ttft_ms_p99": max((r["ttft_ms_p99"] or 0) for r in rows) if rows else None,
        "engine_alone_ttft_ms_p50": pct(alone, 0.5),
        "engine_alone_ttft_ms_p99": pct(alone, 0.99),
        "api_overhead_ms_p50": max(overheads) if overheads else None,
        "rejected_429": sum(r["rejected_429"] for r in rows),
        "errors": sum(r["errors"] for r in rows),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
