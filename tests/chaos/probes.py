"""What a chaos scenario measures besides turns: /healthz latency sampled from a process of its
own, the arrival times of a stream's deltas (the engine's stalls), the engine's block pool."""

from __future__ import annotations

import contextlib
import math
import subprocess
import sys
import threading
import time
from typing import Any

import httpx

from tests.chaos.clients import TurnOutcome, acknowledge, sse_events
from tests.chaos.harness import http_client


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


# The sampler's own process: in the test's process its thread would queue for the GIL behind
# every client thread, and the numbers would be the test's latency, not the server's.
_SAMPLER = """
import http.client, sys, time
host, port, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
interval, timeout = float(sys.argv[4]), float(sys.argv[5])
conn = None
while True:
    t0 = time.perf_counter()
    try:
        conn = conn or http.client.HTTPConnection(host, port, timeout=timeout)
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        status = response.status
    except (OSError, http.client.HTTPException):
        conn, status = None, 0
    ms = (time.perf_counter() - t0) * 1000 if status else timeout * 1000
    print(time.monotonic(), ms, status, flush=True)
    time.sleep(max(0.0, interval - ms / 1000))
"""


class LatencySampler:
    """GET `path` every interval_s from a process of its own; a failed or timed-out probe
    counts as timeout_s (a server that does not answer is slow, not absent from the numbers).
    Times are time.monotonic() (one clock for every process on Linux)."""

    def __init__(
        self, url: str, path: str = "/healthz", interval_s: float = 0.02, timeout_s: float = 2.0
    ) -> None:
        self.host, _, port = url.removeprefix("http://").partition(":")
        self.port = int(port)
        self.path, self.interval_s, self.timeout_s = path, interval_s, timeout_s
        self.samples: list[tuple[float, float, int]] = []  # (monotonic, ms, status)
        self._proc: subprocess.Popen | None = None
        self._reader = threading.Thread(target=self._read, name="healthz-sampler", daemon=True)

    def start(self) -> LatencySampler:
        args = [self.host, str(self.port), self.path, str(self.interval_s), str(self.timeout_s)]
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _SAMPLER, *args], stdout=subprocess.PIPE, text=True
        )
        self._reader.start()
        return self

    def stop(self) -> LatencySampler:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(10)
        self._reader.join(10)
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            t, ms, status = line.split()
            self.samples.append((float(t), float(ms), int(status)))

    def ms(self, since: float = 0.0, until: float = math.inf) -> list[float]:
        return [ms for t, ms, _ in self.samples if since <= t <= until]

    def p99(self, since: float = 0.0, until: float = math.inf) -> float:
        return percentile(self.ms(since, until), 0.99)

    def failures(self) -> int:
        return sum(1 for _, _, status in self.samples if status != 200)


class StreamProbe:
    """One long SSE turn in a thread of its own; when each delta arrived. A gap between
    deltas is time the engine did not step this sequence (or the loop did not send)."""

    def __init__(self, url: str, sid: str, content: str, **sampling: Any) -> None:
        self.url, self.sid, self.content, self.sampling = url, sid, content, sampling
        self.times: list[float] = []
        self.outcome: TurnOutcome | None = None
        self._thread = threading.Thread(target=self._run, name="stream-probe", daemon=True)

    def start(self) -> StreamProbe:
        self._thread.start()
        return self

    def join(self, timeout_s: float) -> TurnOutcome | None:
        self._thread.join(timeout_s)
        return self.outcome

    def _run(self) -> None:
        out = TurnOutcome(self.sid, self.content, 0)
        body = {"content": self.content, "stream": True, **self.sampling}
        with contextlib.suppress(httpx.HTTPError), http_client(self.url, 120) as http:
            path = f"/v1/sessions/{self.sid}/messages"
            with http.stream("POST", path, json=body) as response:
                out.status = response.status_code
                for event in sse_events(response.iter_lines()):
                    if event.get("type") == "delta":
                        self.times.append(time.monotonic())
                    elif event.get("type") == "done":
                        acknowledge(out, event)
                    elif "error" in event:
                        out.code = event["error"].get("code")
        self.outcome = out

    def max_gap_s(self, since: float = 0.0, until: float = math.inf) -> float:
        """The longest wait between two deltas that overlaps [since, until]."""
        pairs = zip(self.times, self.times[1:], strict=False)
        return max((b - a for a, b in pairs if b >= since and a <= until), default=0.0)

    def deltas_between(self, since: float, until: float) -> int:
        return sum(1 for t in self.times if since <= t <= until)


def engine_stats(http: httpx.Client) -> dict[str, Any]:
    return http.get("/admin/cache").json()["engine"]


def wait_idle(http: httpx.Client, timeout_s: float = 30.0) -> dict[str, Any]:
    """Engine stats once nothing runs or waits and every block is back in the pool; raises
    TimeoutError with the last stats otherwise (a leak)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine_stats(http)
        idle = stats["running"] == 0 and stats["waiting"] == 0
        if idle and stats["free_blocks"] == stats["num_blocks"]:
            return stats
        if time.monotonic() > deadline:
            raise TimeoutError(f"engine not idle after {timeout_s} s: {stats}")
        time.sleep(0.1)
