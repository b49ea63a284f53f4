"""Redis killed (SIGKILL, then restarted on its port and data) or hung (SIGSTOP, then SIGCONT)
while sessions post turns and one long stream runs.

With a Redis URL this codebase keeps the session records in Redis too (AttentionStore: records
are RedisRecordStore when a remote is set), so "Redis as a KV tier only" does not exist: this is
Redis for both, with no LMDB KV tier and a small DRAM tier, so that most KV lives in Redis. Redis
writes every change to its append-only file before it answers: records it acknowledged must
survive its kill -9.

    warm-up: turns on every session (their KV spills to Redis), the probe stream starts
    outage:  record operations answer 503 store_unavailable, quickly (never 500, never a hang);
             /healthz stays fast; the probe stream keeps its pace (its record was read before)
    back:    turns succeed again, the breaker closes, and KV held in
             Redis is reused (cached_tokens > 0)
    always:  every acknowledged turn is in its session's history
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.chaos.clients import ChatLoad, HistoryCheck, Ledger, check_history, error_code, post_turn
from tests.chaos.harness import RedisProcess, ServerProcess, wait_until
from tests.chaos.probes import LatencySampler, StreamProbe

GREEDY = {"temperature": 0}
SPARE = "/v1/sessions/redis-spare"  # no client of its own: the outage's probe of record ops


@dataclass
class OutageConfig:
    mode: str = "kill"  # kill | hang
    outage_s: float = 3.0
    sessions: int = 4
    max_tokens: int = 6
    probe_tokens: int = 0  # the stream that spans the outage (0: long enough for outage_s)
    breaker_reset_s: float = 1.0
    recover_timeout_s: float = 30.0


@dataclass
class RecordOp:
    what: str
    status: int
    code: str | None
    seconds: float


@dataclass
class OutageReport:
    mode: str = ""
    outage_s: float = 0.0
    history: HistoryCheck = field(default_factory=HistoryCheck)
    codes: dict[str, int] = field(default_factory=dict)
    record_ops: list[RecordOp] = field(default_factory=list)  # tried during the outage
    server_errors: list[str] = field(default_factory=list)  # failures but 503 store_unavailable
    healthz_p99_ms: float = 0.0  # during the outage
    healthz_max_ms: float = 0.0
    baseline_gap_ms: float = 0.0  # the probe stream's longest gap before the outage
    stall_ms: float = 0.0  # ... and during it
    probe_deltas_during: int = 0
    breaker_seen_open: bool = False
    breaker_metric_seen_open: bool = False
    recovered_s: float | None = None  # outage end -> the first acknowledged turn posted after it
    breaker_closed_s: float | None = None
    resumed_session: str | None = None  # a session whose KV sat (partly) in Redis only
    resumed_stored: int = 0  # ... its stored history, in tokens
    resumed_cached: int = 0  # the turn on that session after recovery: tokens reused
    resumed_bytes_up: int = 0  # KV bytes that turn brought up from Redis
    resurrected_503: int = 0  # turns refused with 503 found in the history later

    @property
    def slowest_refusal_s(self) -> float:
        return max((op.seconds for op in self.record_ops), default=0.0)


def server_env(redis: RedisProcess, config: OutageConfig) -> dict[str, str]:
    return {
        "CHATSTORE_REDIS_URL": redis.url,
        "CHATSTORE_SSD_BYTES": "0",  # no LMDB KV tier: the KV below DRAM is Redis's
        "CHATSTORE_DRAM_BYTES": str(8 << 20),  # ~170 tokens: sessions spill to Redis
        "CHATSTORE_CHUNK_TOKENS": "64",
        "CHATSTORE_KV_CACHE_BYTES": str(128 << 20),  # the probe stream is never preempted
        "CHATSTORE_REDIS_BREAKER_RESET_S": str(config.breaker_reset_s),
        "CHATSTORE_MAX_TURNS_PER_TENANT": "64",
        # Reuse comes from the store alone: a KV hit after the outage is one from Redis.
        "CHATSTORE_ENABLE_PREFIX_CACHE": "false",
    }


def run(work: Path, config: OutageConfig, say: Callable[[str], None] = print) -> OutageReport:
    report = OutageReport(mode=config.mode, outage_s=config.outage_s)
    redis = RedisProcess(work / "redis").start()
    server = ServerProcess(work / "data", server_env(redis, config))
    sampler: LatencySampler | None = None
    try:
        server.start()
        sids = [f"redis-{i}" for i in range(config.sessions)]
        ledger = Ledger()
        _warm_up(server, sids, ledger)
        sampler = LatencySampler(server.url).start()
        probe = StreamProbe(server.url, "redis-probe", "Count slowly.", **_probe_body(config))
        load = ChatLoad(server.url, sids, ledger, max_tokens=config.max_tokens)
        probe.start()
        load.start()
        wait_until(lambda: len(probe.times) > 5, 60, "the probe stream's first deltas")
        time.sleep(1.0)
        began = time.monotonic()
        _outage(redis, server, config, report)
        ended = time.monotonic()
        say(f"  {config.mode}: {config.outage_s:.0f} s outage, {len(report.record_ops)} ops tried")
        report.breaker_closed_s = _wait_closed(server, ended, config.recover_timeout_s)
        _wait_acked_after(ledger, ended, config.recover_timeout_s)
        load.stop()
        if probe.join(120) is not None:
            ledger.add(probe.outcome)
        sampler.stop()
        _measure(report, ledger, sampler, probe, began, ended)
        with server.client(30) as http:
            _resume_hits(http, ledger, report)
            _check(http, ledger, [*sids, "redis-probe"], report)
    finally:
        if sampler is not None:
            sampler.stop()
        server.stop()
        redis.stop()
    return report


def _warm_up(server: ServerProcess, sids: list[str], ledger: Ledger) -> None:
    """The sessions, with histories long enough to leave chunks in Redis."""
    with server.client(30) as http:
        for sid in [*sids, "redis-probe", "redis-spare"]:
            assert http.post("/v1/sessions", json={"id": sid}).status_code == 201
        for sid in sids:
            for turn in range(3):
                out = post_turn(http, sid, f"warm {turn}: name a fruit.", max_tokens=12)
                assert ledger.add(out).acked, out


def _probe_body(config: OutageConfig) -> dict[str, Any]:
    """The stream that spans the outage: long enough to outlast it."""
    tokens = config.probe_tokens or min(1200, int(300 + 60 * config.outage_s))
    return {"max_tokens": tokens, "ignore_eos": True, **GREEDY}


def _outage(
    redis: RedisProcess, server: ServerProcess, config: OutageConfig, report: OutageReport
) -> None:
    """Break Redis for outage_s, trying record operations all along; then bring it back."""
    if config.mode == "kill":
        redis.kill9()
    else:
        redis.pause()
    try:
        deadline = time.monotonic() + config.outage_s
        with server.client(30) as http:
            while time.monotonic() < deadline:
                report.record_ops.extend(_record_ops(http))
                breaker = http.get("/admin/cache").json().get("remote_breaker") or {}
                report.breaker_seen_open |= breaker.get("state") in ("open", "half_open")
                gauge = _metric(http, "chatstore_remote_breaker_open")
                report.breaker_metric_seen_open |= gauge == 1
                time.sleep(0.2)
    finally:
        if config.mode == "kill":
            redis.start()
        else:
            redis.resume()


def _record_ops(http: httpx.Client) -> list[RecordOp]:
    """Each operation that needs a session record, timed."""
    ops = []
    calls: list[tuple[str, Callable[[], httpx.Response]]] = [
        ("get", lambda: http.get(SPARE)),
        ("list", lambda: http.get("/v1/sessions")),
        ("create", lambda: http.post("/v1/sessions", json={})),
        ("turn", lambda: http.post(f"{SPARE}/messages", json={"content": "Hi", "max_tokens": 4})),
    ]
    for what, call in calls:
        t0 = time.perf_counter()
        try:
            r = call()
            status, code = r.status_code, error_code(r)
        except httpx.HTTPError as exc:
            status, code = 0, type(exc).__name__
        ops.append(RecordOp(what, status, code, time.perf_counter() - t0))
    return ops


def _metric(http: httpx.Client, name: str) -> float | None:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def _wait_closed(server: ServerProcess, since: float, timeout_s: float) -> float | None:
    with server.client(30) as http:

        def closed() -> bool:
            breaker = http.get("/admin/cache").json().get("remote_breaker")
            return breaker is not None and breaker["state"] == "closed"

        try:
            wait_until(closed, timeout_s, "the breaker closed", 0.1)
        except TimeoutError:
            return None
    return time.monotonic() - since


def _wait_acked_after(ledger: Ledger, since: float, timeout_s: float) -> None:
    def acked_after() -> bool:
        return any(o.acked and o.started >= since for o in list(ledger.outcomes))

    # A turn that never succeeds shows in the report (recovered_s None), not as a crash here.
    with contextlib.suppress(TimeoutError):
        wait_until(acked_after, timeout_s, "a turn acknowledged after the outage", 0.1)


def _measure(
    report: OutageReport,
    ledger: Ledger,
    sampler: LatencySampler,
    probe: StreamProbe,
    began: float,
    ended: float,
) -> None:
    report.codes = ledger.codes()
    outcomes = list(ledger.outcomes)
    # The one failure an outage may cause is a clear 503 (or an SSE error event saying so).
    report.server_errors = [
        f"{o.content}: {o.status} {o.code}"
        for o in outcomes
        if not o.acked and o.code != "store_unavailable"
    ]
    report.server_errors += [
        f"{op.what}: {op.status} {op.code}" for op in report.record_ops if op.status != 503
    ]
    report.healthz_p99_ms = sampler.p99(began, ended)
    report.healthz_max_ms = max(sampler.ms(began, ended), default=0.0)
    report.baseline_gap_ms = probe.max_gap_s(0.0, began) * 1000
    report.stall_ms = probe.max_gap_s(began, ended) * 1000
    report.probe_deltas_during = probe.deltas_between(began, ended)
    after = [o.started for o in outcomes if o.acked and o.started >= ended]
    report.recovered_s = min(after) - ended if after else None


def _resume_hits(http: httpx.Client, ledger: Ledger, report: OutageReport) -> None:
    """A session whose KV sits only in Redis is reused again by its next turn: the worker
    thread that opens the turn brings the chunks up (the engine's thread never reads Redis)
    and holds them until the engine has read them, however small DRAM is: no client hint
    needed."""
    listed = http.get("/v1/sessions", params={"limit": 100}).json()["data"]
    remote = next((s for s in listed if s["kv_location"] == "remote"), None)
    if remote is None:
        return
    sid = report.resumed_session = remote["id"]
    report.resumed_stored = remote["num_tokens"]
    before = _bytes_up(http)
    out = ledger.add(post_turn(http, sid, "After the outage: one more colour?", max_tokens=4))
    report.resumed_bytes_up = _bytes_up(http) - before
    report.resumed_cached = out.cached_tokens if out.acked else -out.status


def _bytes_up(http: httpx.Client) -> int:
    """KV bytes moved up the tiers so far (from Redis into DRAM, here)."""
    tiers: list[dict[str, Any]] = http.get("/admin/cache").json()["tiers"]
    return sum(t["bytes_up"] for t in tiers)


def _check(http: httpx.Client, ledger: Ledger, sids: list[str], report: OutageReport) -> None:
    for sid in sids:
        r = http.get(f"/v1/sessions/{sid}")
        assert r.status_code == 200, r.text
        messages = r.json()["messages"]
        report.history.merge(check_history(messages, ledger.of(sid)))
        stored = {m["content"] for m in messages if m["role"] == "user"}
        report.resurrected_503 += sum(
            1 for o in ledger.of(sid) if o.status == 503 and o.content in stored
        )
