"""A throwaway local `redis-server` (tests, benchmarks): free loopback port, no persistence."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass


@dataclass
class LocalRedis:
    port: int
    process: subprocess.Popen

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def redis_server_binary() -> str | None:
    found = shutil.which("redis-server")
    return found or ("/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None)


def start_local_redis(timeout_s: float = 10.0) -> LocalRedis:
    """Start `redis-server` on 127.0.0.1:<free port> and wait until it answers PING."""
    import redis

    binary = redis_server_binary()
    if binary is None:
        raise FileNotFoundError("redis-server is not installed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly"]
    process = subprocess.Popen([*args, "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = LocalRedis(port, process)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if redis.Redis(port=port, socket_timeout=1).ping():
                return server
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
    server.stop()
    raise RuntimeError(f"redis-server did not start on port {port}")
