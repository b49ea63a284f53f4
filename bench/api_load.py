"""API load: N concurrent multi-turn clients streaming over SSE, WebSocket and Responses.

The server runs as its own process (`chatstore serve` on a loopback port, real model, engine and
store); each client owns a session (the Responses client: a chain of responses, each continuing
the last by `previous_response_id`) and keeps conversing for `--duration` seconds. Per turn it
records the TTFT it sees (request sent -> first token delta received) and the engine's own TTFT,
which the server reports in the turn's final event (Request created -> first token sampled).

    api_overhead    = client TTFT - engine TTFT, per turn (parse, auth, template, hand-over to
                      and from the engine thread, SSE/WebSocket framing, loopback both ways,
                      the client library)
    server_overhead = the server's own share: request arrival -> first token on the event loop,
                      minus the engine TTFT

Per turn it also records the time per output token after the first (first delta -> last delta,
over completion_tokens - 1), as the client sees it:

    per_token_overhead = that, minus the same measured on the engine alone (p50 and mean;
                         "paired": the median over rounds of each round's difference)
    loop_cpu_per_token = CPU time of the server's event-loop thread (HTTP, JSON, SSE/WebSocket
                         framing, the hand-over from the engine thread, and each request's own
                         handling spread over its tokens) per generated token, from /proc; on the
                         engine alone, the consuming loop's own
    client_cpu_per_token = the same for this process's clients (they share the machine's cores)

Unless --no-engine-alone, after each transport's phase the same number of concurrent turns runs
straight against an in-process AsyncEngine (no HTTP at all) for the TTFT and time per token of
the engine alone; `--rounds N` repeats transports and engine alone N times, alternating, so that
whatever else runs on the machine weighs on both alike. Even so, the time per token is only as
steady as the machine: on a few shared cores other processes move it by more than the API costs,
and the loop's CPU per token (x the number of streams: what each step's tokens cost the loop,
which holds the GIL the engine thread needs meanwhile) is the steadier measure of the API's own
cost. Intended 429s (queue full) are retried after Retry-After and counted apart; anything else
is an error. The last line printed is one JSON object; `<transport>_overhead_ms_p50` is each
transport's api_overhead p50, `api_overhead_ms_p50` the worst of them.

    python bench/api_load.py [--clients 8] [--duration 20] [--max-tokens 16] [--ignore-eos]
                             [--transports sse,ws,responses] [--rounds 1] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
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
    per_token: list[float] = field(default_factory=list)  # seconds per token after the first
    turns: int = 0
    tokens: int = 0
    rejected: int = 0  # intended 429s
    errors: list[str] = field(default_factory=list)

    def add(self, ttft: float | None, done: dict, decode_s: float | None = None) -> None:
        self.turns += 1
        self.tokens += done["usage"]["completion_tokens"]
        if decode_s is not None and done["usage"]["completion_tokens"] > 1:
            self.per_token.append(decode_s / (done["usage"]["completion_tokens"] - 1))
        engine = done["timings"]["engine_ttft_ms"]
        if ttft is not None and engine is not None:
            self.ttft.append(ttft)
            self.engine_ttft.append(engine / 1000)
            self.overhead.append(ttft - engine / 1000)
            self.server_overhead.append((done["timings"]["ttft_ms"] - engine) / 1000)


def mean_ms(values: list[float]) -> float | None:
    return sum(values) / len(values) * 1000 if values else None


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def thread_cpu_s(pid: int, tid: int) -> float | None:
    """CPU seconds (user + system) one thread has used so far, from /proc (Linux only)."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
                "max_tokens": args.max_tokens, "temperature": 0,
                "ignore_eos": args.ignore_eos}  # fmt: skip
        sent, first, last = time.perf_counter(), None, None
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
                if event.get("type") == "delta":
                    last = time.perf_counter() - sent
                    first = last if first is None else first
                elif event.get("type") == "done":
                    stats.add(first, event, None if first is None else last - first)
                elif "error" in event:
                    stats.errors.append(f"sse stream error: {event['error']}")
        turn += 1


async def responses_client(
    http: httpx.AsyncClient, i: int, stop: float, args, stats: Stats
) -> None:
    """The Responses API streamed, each turn continuing the last (`previous_response_id`)."""
    previous = None
    turn = 0
    while time.monotonic() < stop:
        body = {"input": PROMPTS[(i + turn) % len(PROMPTS)], "instructions": "Be brief.",
                "stream": True, "max_output_tokens": args.max_tokens, "temperature": 0,
                "ignore_eos": args.ignore_eos, "previous_response_id": previous}  # fmt: skip
        sent, first, last = time.perf_counter(), None, None
        async with http.stream("POST", "/v1/responses", json=body) as r:
            if r.status_code == 429:
                stats.rejected += 1
                await asyncio.sleep(float(r.headers.get("Retry-After", "1")))
                continue
            if r.status_code != 200:
                stats.errors.append(f"responses {r.status_code}: {(await r.aread())[:200]!r}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                kind = event["type"]
                if kind == "response.output_text.delta":
                    last = time.perf_counter() - sent
                    first = last if first is None else first
                elif kind in ("response.completed", "response.incomplete"):
                    done = event["response"]
                    previous = done["id"]
                    usage = {"completion_tokens": done["usage"]["output_tokens"]}
                    turn_done = {"usage": usage, "timings": done["timings"]}
                    stats.add(first, turn_done, None if first is None else last - first)
                elif kind in ("response.failed", "error"):
                    stats.errors.append(f"responses stream error: {line[6:200]}")
        turn += 1


async def ws_client(url: str, http: httpx.AsyncClient, i: int, stop: float, args, stats: Stats):
    sid = (await http.post("/v1/sessions", json={"system_prompt": "Be brief."})).json()["id"]
    async with websockets.connect(f"{url}/v1/sessions/{sid}/ws", proxy=None) as ws:
        json.loads(await ws.recv())  # ready
        turn = 0
        while time.monotonic() < stop:
            frame = {"type": "message", "content": PROMPTS[(i + turn) % len(PROMPTS)],
                     "max_tokens": args.max_tokens, "temperature": 0,
                     "ignore_eos": args.ignore_eos}  # fmt: skip
            sent, first, last = time.perf_counter(), None, None
            await ws.send(json.dumps(frame))
            while True:
                event = json.loads(await ws.recv())
                if event["type"] == "delta":
                    last = time.perf_counter() - sent
                    first = last if first is None else first
                elif event["type"] == "done":
                    stats.add(first, event, None if first is None else last - first)
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
        elif transport == "responses":
            jobs = [responses_client(http, i, stop, args, stats) for i in range(args.clients)]
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


class EngineAlone:
    """An in-process AsyncEngine (the server's config, no HTTP), run phase by phase."""

    def __init__(self, data_dir: str) -> None:
        from chatstore.config import load_config
        from chatstore.serving import build

        self.serving = build(load_config(overrides={"data_dir": data_dir}, env={}))
        self.engine = self.serving.engine
        self.engine.start()
        self.phases = 0

    async def phase(self, args) -> tuple[list[float], list[float], float | None]:
        """(TTFT, seconds per token after the first, consuming loop's CPU ms per token) of
        `clients` concurrent multi-turn conversations for `duration` seconds."""
        from chatstore.engine.request import Request, SamplingParams

        engine, template, tag = self.engine, self.serving.template, self.phases
        self.phases += 1
        ttfts: list[float] = []
        per_token: list[float] = []
        stop = time.monotonic() + args.duration

        async def client(i: int) -> None:
            history = [{"role": "system", "content": "Be brief."}]
            turn = 0
            while time.monotonic() < stop:
                history.append({"role": "user", "content": PROMPTS[(i + turn) % len(PROMPTS)]})
                sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0,
                                          ignore_eos=args.ignore_eos)  # fmt: skip
                request = Request(f"alone-{tag}-{i}-{turn}", template.render(history), sampling,
                                  session_id=f"alone-{tag}-{i}")  # fmt: skip
                sent, first, last, text, tokens = time.perf_counter(), None, None, "", 0
                async for out in engine.submit(request):
                    for sample in out.samples:
                        if sample.token_ids:
                            last = time.perf_counter() - sent
                            first = last if first is None else first
                        tokens += len(sample.token_ids)
                        text += sample.text
                if first is not None:
                    ttfts.append(first)
                    if tokens > 1:
                        per_token.append((last - first) / (tokens - 1))
                history.append({"role": "assistant", "content": text})
                turn += 1

        cpu, generated = time.thread_time(), engine.stats().tokens_generated
        await asyncio.gather(*(client(i) for i in range(args.clients)))
        cpu, generated = time.thread_time() - cpu, engine.stats().tokens_generated - generated
        return ttfts, per_token, cpu * 1000 / generated if generated else None

    def close(self) -> None:
        asyncio.run(self.engine.shutdown())
        self.serving.close()


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
        "per_token_ms_p50": pct(stats.per_token, 0.5),
        "per_token_ms_mean": mean_ms(stats.per_token),
        "rejected_429": stats.rejected,
        "errors": len(stats.errors),
    }
    shown = {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}
    print(" ".join(f"{k}={v}" for k, v in shown.items()), flush=True)
    for err in stats.errors[:5]:
        print(f"  error: {err}", flush=True)
    return row


def run_transport(proc: subprocess.Popen, url: str, args, transport: str) -> tuple[Stats, dict]:
    """One phase of one transport: its stats, and its row (with the CPU per token)."""
    cpu = thread_cpu_s(proc.pid, proc.pid)  # uvicorn's event loop: the server's main thread
    client_cpu = time.thread_time()
    stats, elapsed = asyncio.run(drive(url, args, transport))
    client_cpu = time.thread_time() - client_cpu
    after = thread_cpu_s(proc.pid, proc.pid)
    row = report(transport, stats, elapsed)
    row["loop_cpu_ms_per_token"] = row["client_cpu_ms_per_token"] = None
    if cpu is not None and after is not None and stats.tokens:
        row["loop_cpu_ms_per_token"] = round((after - cpu) * 1000 / stats.tokens, 3)
    if stats.tokens:
        row["client_cpu_ms_per_token"] = round(client_cpu * 1000 / stats.tokens, 3)
    loop_ms, client_ms = row["loop_cpu_ms_per_token"], row["client_cpu_ms_per_token"]
    print(f"  cpu_ms_per_token: server event loop {loop_ms}, clients {client_ms}", flush=True)
    return stats, row


def merge_stats(phases: list[Stats]) -> Stats:
    out = Stats()
    for s in phases:
        for name in ("ttft", "engine_ttft", "overhead", "server_overhead", "per_token", "errors"):
            getattr(out, name).extend(getattr(s, name))
        out.turns, out.tokens = out.turns + s.turns, out.tokens + s.tokens
        out.rejected += s.rejected
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per phase")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--ignore-eos", action="store_true", help="every turn max-tokens long")
    parser.add_argument("--transports", default="sse,ws,responses")
    parser.add_argument("--no-engine-alone", action="store_true")
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="alternate every transport and the engine alone this many times, so that what "
        "else runs on the machine weighs on both alike; overheads are paired per round",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="4 clients, 8 s, 8 tokens")
    args = parser.parse_args()
    if args.quick:
        args.clients, args.duration, args.max_tokens = 4, 8.0, 8
    from chatstore.server.run import SWITCH_INTERVAL_S

    sys.setswitchinterval(SWITCH_INTERVAL_S)  # as the server runs its engine thread
    transports = args.transports.split(",")
    phases: dict[str, list[tuple[Stats, dict]]] = {t: [] for t in transports}
    alone_phases: list[tuple[list[float], list[float], float | None]] = []
    with tempfile.TemporaryDirectory(prefix="chatstore-bench-") as data_dir:
        proc, url = start_server(args, os.path.join(data_dir, "server"))
        alone = None
        try:
            if not args.no_engine_alone:
                alone = EngineAlone(os.path.join(data_dir, "alone"))
            for _ in range(args.rounds):
                for transport in transports:
                    phases[transport].append(run_transport(proc, url, args, transport))
                if alone is not None:
                    alone_phases.append(asyncio.run(alone.phase(args)))
                    ttft, per_token, cpu = alone_phases[-1]
                    print(f"engine alone: turns={len(ttft)} ttft_ms_p50={pct(ttft, 0.5)} "
                          f"per_token_ms_p50={pct(per_token, 0.5)} cpu_ms_per_token={cpu}",
                          flush=True)  # fmt: skip
        finally:
            proc.terminate()
            proc.wait(60)
            if alone is not None:
                alone.close()
    alone_ttft = [t for ttft, _, _ in alone_phases for t in ttft]
    alone_per_token = [t for _, per_token, _ in alone_phases for t in per_token]
    engine_per_token = {"p50": pct(alone_per_token, 0.5), "mean": mean_ms(alone_per_token)}
    rows = []
    for transport in transports:
        done = phases[transport]
        if len(done) == 1:
            row = done[0][1]
        else:
            print(f"{transport}, all {len(done)} rounds:")
            row = report(transport, merge_stats([s for s, _ in done]), args.duration * len(done))
            for key in ("loop_cpu_ms_per_token", "client_cpu_ms_per_token"):
                values = [r[key] for _, r in done if r[key] is not None]
                row[key] = round(statistics.median(values), 3) if values else None
        for stat, engine_value in engine_per_token.items():
            value = row[f"per_token_ms_{stat}"]
            row[f"per_token_overhead_ms_{stat}"] = (
                None if value is None or engine_value is None else round(value - engine_value, 3)
            )
        # Paired by round: each transport phase against the engine-alone phase right after it.
        paired = [
            pct(stats.per_token, 0.5) - pct(alone_round[1], 0.5)
            for (stats, _), alone_round in zip(done, alone_phases, strict=False)
            if stats.per_token and alone_round[1]
        ]
        row["per_token_overhead_ms_paired_p50"] = (
            round(statistics.median(paired), 3) if paired else None
        )
        row["per_token_overhead_ms_by_round"] = [round(d, 3) for d in paired]
        rows.append(row)
    overheads = [r["api_overhead_ms_p50"] for r in rows if r["api_overhead_ms_p50"] is not None]
    by_transport = {r["transport"]: r["api_overhead_ms_p50"] for r in rows}
    http_ttft = [r["ttft_ms_p50"] for r in rows if r["ttft_ms_p50"] is not None]
    alone_cpu = [cpu for _, _, cpu in alone_phases if cpu is not None]
    result = {
        "clients": args.clients,
        "duration_s": args.duration,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "transports": rows,
        "requests_per_s": round(sum(r["requests_per_s"] for r in rows) / max(len(rows), 1), 3),
        "ttft_ms_p50": max(http_ttft) if http_ttft else None,
        "ttft_ms_p99": max((r["ttft_ms_p99"] or 0) for r in rows) if rows else None,
        "engine_alone_ttft_ms_p50": pct(alone_ttft, 0.5),
        "engine_alone_ttft_ms_p99": pct(alone_ttft, 0.99),
        "api_overhead_ms_p50": max(overheads) if overheads else None,
        **{f"{t}_overhead_ms_p50": by_transport.get(t) for t in ("sse", "ws", "responses")},
        "engine_alone_per_token_ms_p50": engine_per_token["p50"],
        "engine_alone_per_token_ms_mean": engine_per_token["mean"],
        "engine_alone_loop_cpu_ms_per_token": (
            round(statistics.median(alone_cpu), 3) if alone_cpu else None
        ),
        "per_token_overhead_ms_p50": _worst(rows, "per_token_overhead_ms_p50"),
        "per_token_overhead_ms_mean": _worst(rows, "per_token_overhead_ms_mean"),
        "per_token_overhead_ms_paired_p50": _worst(rows, "per_token_overhead_ms_paired_p50"),
        "loop_cpu_ms_per_token": _worst(rows, "loop_cpu_ms_per_token"),
        "client_cpu_ms_per_token": _worst(rows, "client_cpu_ms_per_token"),
        "rejected_429": sum(r["rejected_429"] for r in rows),
        "errors": sum(r["errors"] for r in rows),
    }
    print(json.dumps(result))


def _worst(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return max(values) if values else None


if __name__ == "__main__":
    main()
