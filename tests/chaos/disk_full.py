"""The session records store fills up while turns run, two ways:

    map   LMDB's map is small (records_map_bytes) and sessions with big metadata fill it
    disk  the data dir is a tiny tmpfs (a real ENOSPC; needs the right to mount: skipped, with
          the reason, where it is missing)

Once full: turns and creates are refused with 507 store_full (SSE: an error event), never a 5xx
of another kind; reads (GET a session, the list) keep working; no acknowledged turn is lost and
no refused one is kept. After the filler sessions are deleted, turns succeed again.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.chaos.clients import (
    ChatLoad,
    HistoryCheck,
    Ledger,
    check_history,
    error_code,
    post_turn,
)
from tests.chaos.harness import ServerProcess, wait_until

BIG_METADATA = {f"k{i}": "x" * 900 for i in range(16)}  # ~15 KB as JSON, under the 16 KB cap
MAX_FILLERS = 2000


@dataclass
class DiskFullConfig:
    kind: str = "map"  # map | disk
    map_bytes: int = 3 << 19  # 1.5 MiB (kind map)
    tmpfs_bytes: int = 8 << 20  # (kind disk)
    sessions: int = 3  # chatting while the store fills
    max_tokens: int = 6
    full_s: float = 1.0  # turns keep trying this long once each has been refused
    refused_within_s: float = 60.0


@dataclass
class DiskFullReport:
    kind: str = ""
    skipped: str | None = None  # why the scenario could not run here
    fillers: int = 0
    full_status: int = 0  # what the create that found the store full got
    full_code: str | None = None
    refusals_while_full: int = 0  # turns refused with store_full (507, SSE error event)
    server_errors: list[str] = field(default_factory=list)  # any other failure
    reads: dict[str, int] = field(default_factory=dict)  # status of each read while full
    history: HistoryCheck = field(default_factory=HistoryCheck)
    recovered: bool = False  # turns and a create succeed after the fillers are deleted
    codes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


def run(work: Path, config: DiskFullConfig, say: Callable[[str], None] = print) -> DiskFullReport:
    t0 = time.monotonic()
    report = DiskFullReport(kind=config.kind)
    with _data_dir(work, config, report) as data:
        if data is None:
            return report
        env = {"CHATSTORE_MAX_METADATA_BYTES": "16384", "CHATSTORE_PURGE_INTERVAL_S": "0"}
        if config.kind == "map":
            env["CHATSTORE_RECORDS_MAP_BYTES"] = str(config.map_bytes)
        server = ServerProcess(data, env)
        server.log_path = work / f"{config.kind}-server.log"  # not on the full disk
        try:
            server.start()
            _scenario(server, config, report)
        finally:
            server.stop()
    report.seconds = time.monotonic() - t0
    say(f"  {config.kind} full after {report.fillers} filler sessions: {report.codes}")
    return report


def _scenario(server: ServerProcess, config: DiskFullConfig, report: DiskFullReport) -> None:
    sids = [f"full-{i}" for i in range(config.sessions)]
    ledger = Ledger()
    with server.client(60) as http:
        for sid in sids:
            assert http.post("/v1/sessions", json={"id": sid}).status_code == 201
        load = ChatLoad(server.url, sids, ledger, max_tokens=config.max_tokens).start()
        try:
            fillers = _fill(http, report)

            def each_refused() -> bool:
                refused = {o.session_id for o in ledger.outcomes if o.refused}
                return refused >= set(sids)

            # Every acknowledged turn grows its record: each session soon finds the store full
            # (what it is told is checked by the caller: 507 store_full).
            with contextlib.suppress(TimeoutError):
                wait_until(each_refused, config.refused_within_s, "a turn refused per session")
            time.sleep(config.full_s)
            report.reads = _reads(http, sids[0], fillers)
        finally:
            load.stop()
        report.refusals_while_full = sum(1 for o in ledger.outcomes if o.code == "store_full")
        report.server_errors = [
            f"{o.content}: {o.status} {o.code}"
            for o in ledger.outcomes
            if not o.acked and o.code != "store_full"
        ]
        for sid in fillers:
            r = http.delete(f"/v1/sessions/{sid}")
            if r.status_code != 200:
                report.server_errors.append(f"delete {sid}: {r.status_code} {r.text[:200]}")
        again = [
            ledger.add(post_turn(http, sid, f"[{sid}] after the delete", max_tokens=4))
            for sid in sids
        ]
        created = http.post("/v1/sessions", json={"metadata": BIG_METADATA}).status_code
        report.recovered = all(o.acked for o in again) and created == 201
        for sid in sids:
            r = http.get(f"/v1/sessions/{sid}")
            assert r.status_code == 200, r.text
            report.history.merge(check_history(r.json()["messages"], ledger.of(sid)))
    report.codes = ledger.codes()


def _fill(http: httpx.Client, report: DiskFullReport) -> list[str]:
    """Sessions with big metadata until a create is refused, then bare ones until a create is
    refused again (the room left is smaller than a big one); their ids."""
    fillers: list[str] = []
    for body in ({"metadata": BIG_METADATA}, {}):
        for _ in range(MAX_FILLERS):
            r = http.post("/v1/sessions", json=body)
            if r.status_code != 201:
                report.full_status, report.full_code = r.status_code, error_code(r)
                break
            fillers.append(r.json()["id"])
    report.fillers = len(fillers)
    return fillers


def _reads(http: httpx.Client, sid: str, fillers: list[str]) -> dict[str, int]:
    reads = {
        "get": http.get(f"/v1/sessions/{sid}").status_code,
        "list": http.get("/v1/sessions", params={"limit": 100}).status_code,
    }
    if fillers:
        reads["get_filler"] = http.get(f"/v1/sessions/{fillers[-1]}").status_code
    return reads


@contextlib.contextmanager
def _data_dir(work: Path, config: DiskFullConfig, report: DiskFullReport) -> Iterator[Path | None]:
    """The server's data dir: plain for `map`; for `disk` on a tmpfs of tmpfs_bytes (None,
    with report.skipped saying why, where it cannot be mounted)."""
    if config.kind == "map":
        yield work / "map-data"
        return
    mount = work / "tmpfs"
    mount.mkdir(parents=True, exist_ok=True)
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={config.tmpfs_bytes}", "tmpfs", str(mount)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        done = subprocess.CompletedProcess(cmd, 1, "", str(exc))
    if done.returncode != 0:
        report.skipped = f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode})"
        yield None
        return
    try:
        yield mount / "data"
    finally:
        _unmount(mount)


def _unmount(mount: Path) -> None:
    def unmounted() -> bool:
        return subprocess.run(["umount", str(mount)], capture_output=True).returncode == 0

    try:
        wait_until(unmounted, 10, f"umount {mount}", 0.2)
    except TimeoutError:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)
