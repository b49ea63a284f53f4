"""Redis outages on demand, for tests: a redis-server of the test's own, hung or killed.

Hung is SIGSTOP: the kernel still accepts connections and buffers requests, nobody answers (what
a stalled or partitioned server looks like to a client). Dead is SIGKILL: connections refused.
"""

from __future__ import annotations

import collections
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import pytest
import redis

from tests.support.redis_server import LocalRedis, redis_server_binary, start_local_redis


def own_server() -> Iterator[LocalRedis]:
    """A redis-server for one test alone (the shared one must never be stopped); the
    `own_redis` fixture of tests/conftest.py."""
    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed")
    server = start_local_redis()
    yield server
    _resume(server.process.pid)
    server.stop()


@contextmanager
def hung(server: LocalRedis, max_s: float = 3.0) -> Iterator[None]:
    """Redis stopped for the block, resumed at its end, or after max_s at the latest: code that
    would wait for it forever makes the test fail on its timings instead of hanging it."""
    pid = server.process.pid
    os.kill(pid, signal.SIGSTOP)
    _wait_stopped(pid)  # the signal is asynchronous: no reply may slip out after this returns
    timer = threading.Timer(max_s, _resume, (pid,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        _resume(pid)


def kill(server: LocalRedis) -> None:
    server.process.kill()
    server.process.wait()


def _wait_stopped(pid: int, within_s: float = 5.0) -> None:
    """Until the kernel reports the process stopped (state T in /proc/PID/stat)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "T":
                    return
        except (FileNotFoundError, IndexError):
            return  # gone, or no procfs: nothing to wait for
        time.sleep(0.001)
    raise AssertionError(f"redis-server {pid} did not stop within {within_s} s of SIGSTOP")


def _resume(pid: int) -> None:
    with suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


@contextmanager
def redis_sends(monkeypatch) -> Iterator[collections.Counter[str]]:
    """Commands written to any Redis socket inside the block, by the name of the thread that
    wrote them: "gives up after one try", "no socket I/O" and "the engine thread never talks
    to Redis", counted rather than timed."""
    sends: collections.Counter[str] = collections.Counter()
    send = redis.connection.AbstractConnection.send_packed_command

    def counting(self, *args, **kwargs):
        sends[threading.current_thread().name] += 1
        return send(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(redis.connection.AbstractConnection, "send_packed_command", counting)
        yield sends
