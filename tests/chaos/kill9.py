"""kill -9 under load, over and over, on one data dir.

cycle: start ─► sessions post turns (one thread each, JSON and SSE turns alternating)
            ─► the first turn of the cycle is acknowledged (the kill is armed)
            ─► SIGKILL at a seeded random moment after it ─► threads see the connection drop
  Arming on an acknowledgement, not on a clock, makes a cycle mean the same on every CPU: with
  fixed windows a slow CPU (an AVX2-only machine, fp32) was killed before any turn finished in
  9 cycles of 10, so the test checked almost nothing there.
last cycle: the load stops, quiet_s later the kill (past persist_lag_s, so every
  completed chunk has reached LMDB); or, with quiet_s = 0, the kill comes under load after
  last_up_s of it: the write-back yields to prefills only until a chunk's deadline
  (persist_lag_s), so what was stored that long before the kill is on SSD all the same
then: copy the data dir (a crash image), restart on the original
  - every acknowledged turn is in its session's history, in order, with the reply seen
  - a session deleted under load stays deleted
  - the next turn reuses the KV held in LMDB (cached_tokens > 0)
  - its greedy reply equals a recompute server's (kv_store = off on the copy: the same
    prompt ids rebuilt from the record, no stored KV)
"""

from __future__ import annotations

import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.chaos.clients import ChatLoad, HistoryCheck, Ledger, check_history, post_turn
from tests.chaos.harness import ServerProcess

ENV = {
    "CHATSTORE_PERSIST_LAG_S": "0.2",
    "CHATSTORE_CHUNK_TOKENS": "64",
    "CHATSTORE_KV_CACHE_BYTES": str(128 << 20),
}
GREEDY = {"temperature": 0}
FINAL = "One more colour, please."
DELETED = "kill9-deleted"
ARM_TIMEOUT_S = 120.0  # a liveness bound: the first turn of a cycle, on the slowest CPU


@dataclass
class Kill9Config:
    cycles: int = 10
    sessions: int = 8
    up_s: tuple[float, float] = (0.5, 2.5)  # load between the first ack and the kill (seeded)
    max_tokens: int = 6
    quiet_s: float = 1.5  # before the last kill (0: killed under load)
    last_up_s: float | None = None  # load before the last kill (None: drawn as up_s)
    seed: int = 12


@dataclass
class Kill9Report:
    cycles: int = 0
    sent: int = 0
    history: HistoryCheck = field(default_factory=HistoryCheck)
    deleted_back: bool = False  # the session deleted under load came back
    final_cached: dict[str, int] = field(default_factory=dict)  # sid -> cached_tokens
    mismatches: list[str] = field(default_factory=list)  # final replies != recompute's
    codes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def wrong_replies(self) -> int:
        return len(self.history.wrong) + len(self.mismatches)


def run(work: Path, config: Kill9Config, say: Callable[[str], None] = print) -> Kill9Report:
    t0 = time.monotonic()
    rng = random.Random(config.seed)
    report = Kill9Report()
    ledger = Ledger()
    sids = [f"kill9-{i}" for i in range(config.sessions)]
    server = ServerProcess(work / "data", ENV)
    recompute = ServerProcess(work / "copy", {**ENV, "CHATSTORE_KV_STORE": "off"})
    try:
        for cycle in range(config.cycles):
            server.start()
            if cycle == 0:
                _create(server, [*sids, DELETED])
            up = rng.uniform(*config.up_s)
            last = cycle == config.cycles - 1
            if last and config.last_up_s is not None:
                up = config.last_up_s
            quiet = config.quiet_s if last else 0.0
            _load_then_kill(server, sids, cycle, (up, quiet), ledger, config.max_tokens)
            report.cycles += 1
            say(f"  cycle {cycle}: killed after {up:.2f} s of load, {ledger.acked} acked so far")
        shutil.copytree(server.data_dir, recompute.data_dir)  # the crash image
        server.start()
        _check(server, sids, ledger, report)
        ours = _final_turns(server, sids)
        server.stop()
        recompute.start()
        theirs = _final_turns(recompute, sids)
        for sid in sids:
            report.final_cached[sid] = ours[sid].cached_tokens
            if ours[sid].reply is None or ours[sid].reply != theirs[sid].reply:
                report.mismatches.append(f"{sid}: {ours[sid].reply!r} != {theirs[sid].reply!r}")
    finally:
        server.stop()
        recompute.stop()
    report.sent = len(ledger.outcomes)
    report.codes = ledger.codes()
    report.seconds = time.monotonic() - t0
    return report


def _create(server: ServerProcess, sids: list[str]) -> None:
    with server.client() as http:
        for sid in sids:
            r = http.post("/v1/sessions", json={"id": sid, "system_prompt": "Be brief."})
            assert r.status_code == 201, r.text
        assert post_turn(http, DELETED, "Name a colour.", max_tokens=4).acked  # it has KV


def _load_then_kill(
    server: ServerProcess,
    sids: list[str],
    cycle: int,
    up_quiet_s: tuple[float, float],
    ledger: Ledger,
    max_tokens: int,
) -> None:
    """Load until the cycle's first acknowledged turn, then up_s more, then the kill; with
    quiet_s the load stops first and the kill comes quiet_s later."""
    acked_before = ledger.acked
    load = ChatLoad(server.url, sids, ledger, f"c{cycle} ", max_tokens).start()
    if cycle == 1:  # a delete under load: the session must not come back after the kills
        with server.client() as http:
            assert http.delete(f"/v1/sessions/{DELETED}").status_code == 200
    up_s, quiet_s = up_quiet_s
    _wait_for_an_ack(ledger, acked_before, cycle)
    time.sleep(up_s)
    if quiet_s:
        load.stop()
        time.sleep(quiet_s)
    server.kill9()
    load.stop()  # the clients see their connections drop


def _wait_for_an_ack(ledger: Ledger, acked_before: int, cycle: int) -> None:
    deadline = time.monotonic() + ARM_TIMEOUT_S
    while ledger.acked <= acked_before:
        if time.monotonic() > deadline:
            raise AssertionError(f"cycle {cycle}: no turn acknowledged in {ARM_TIMEOUT_S:.0f} s")
        time.sleep(0.05)


def _check(server: ServerProcess, sids: list[str], ledger: Ledger, report: Kill9Report) -> None:
    with server.client() as http:
        for sid in sids:
            r = http.get(f"/v1/sessions/{sid}")
            assert r.status_code == 200, r.text
            report.history.merge(check_history(r.json()["messages"], ledger.of(sid)))
        report.deleted_back = http.get(f"/v1/sessions/{DELETED}").status_code != 404


def _final_turns(server: ServerProcess, sids: list[str]) -> dict:
    # One at a time: the comparison is of greedy tokens, so batch composition stays out of it.
    with server.client() as http:
        return {sid: post_turn(http, sid, FINAL, max_tokens=8, **GREEDY) for sid in sids}
