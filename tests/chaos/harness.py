"""The processes a chaos scenario breaks: `chatstore serve` on a loopback port (started, killed
with -9, restarted on the same data dir) and a redis-server of its own (killed, hung with
SIGSTOP, restarted on the same port and data). Every wait here is bounded.

    server = ServerProcess(tmp / "data", {"CHATSTORE_PERSIST_LAG_S": "0.2"}).start()
    server.kill9(); server.start()          # same port, same data dir
    redis = RedisProcess(tmp / "redis").start()
    with redis.hung(3.0): ...               # SIGSTOP, SIGCONT when the block ends
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def terminate(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if the process outlives timeout_s; reaped either way."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout_s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(
    condition: Callable[[], T], timeout_s: float, what: str = "condition", interval_s: float = 0.05
) -> T:
    """condition()'s first truthy value; TimeoutError naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout_s} s")
        time.sleep(interval_s)


def rss_bytes(pid: int, kind: str = "VmRSS") -> int:
    """Resident memory of a process from /proc: VmRSS (all), RssAnon (heap: where a leak
    shows) or RssFile (mapped files: LMDB pages, reclaimable)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(kind + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {kind} for pid {pid}")


def http_client(url: str, timeout_s: float = 60.0) -> httpx.Client:
    # trust_env off: a proxy set in the environment must not see loopback traffic.
    return httpx.Client(base_url=url, timeout=timeout_s, trust_env=False)


# Local mode (no keys), a small device pool; scenarios add their own keys.
BASE_ENV = {
    "CHATSTORE_API_KEYS": "",
    "CHATSTORE_ADMIN_KEY": "",
    "CHATSTORE_KV_CACHE_BYTES": str(64 << 20),
    "CHATSTORE_DRAM_BYTES": str(256 << 20),
    "CHATSTORE_LOG_LEVEL": "info",
}


class ServerProcess:
    """`python -m chatstore serve` on a fixed loopback port; stdout and stderr go to a log file
    (a pipe nobody reads would block the server once full)."""

    def __init__(
        self,
        data_dir: Path,
        env: dict[str, str] | None = None,
        port: int = 0,
        runner: tuple[str, ...] = (),
    ) -> None:
        self.data_dir = Path(data_dir)
        self.runner = runner  # what runs the interpreter, e.g. an emulator's command line
        self.port = port or free_port()
        self.env = {**BASE_ENV, "CHATSTORE_DATA_DIR": str(self.data_dir), **(env or {})}
        self.log_path = self.data_dir.parent / f"{self.data_dir.name}-server.log"
        self.proc: subprocess.Popen | None = None
        self._log: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_s: float = 120.0) -> ServerProcess:
        assert not self.alive(), "already running"
        # Only the model's home and the dtype (tests/conftest.py pins it) pass from the caller's
        # CHATSTORE_* settings: a developer's CHATSTORE_REDIS_URL would silently change the
        # scenario.
        inherited = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("CHATSTORE_") or k in ("CHATSTORE_HOME", "CHATSTORE_DTYPE")
        }
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed in _reap)
        self._log.write(f"--- start {time.strftime('%H:%M:%S')} ---\n".encode())
        self._log.flush()
        self.proc = subprocess.Popen(
            [*self.runner, sys.executable, "-m", "chatstore", "serve", "--port", str(self.port)],
            env={**inherited, **self.env},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        with http_client(self.url, 1.0) as http:
            while True:
                if not self.alive():
                    raise RuntimeError(f"server exited while starting:\n{self.log_tail()}")
                with contextlib.suppress(httpx.TransportError):
                    if http.get("/readyz").status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"server not ready in {timeout_s} s:\n{self.log_tail()}")
                time.sleep(0.1)

    def kill9(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
        self._reap(30.0)

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM (drain, flush), SIGKILL if it outlives timeout_s; the exit status."""
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self._reap(30.0)

    def _reap(self, timeout_s: float) -> int | None:
        code = self.proc.wait(timeout_s) if self.proc is not None else None
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def rss(self, kind: str = "VmRSS") -> int:
        return rss_bytes(self.pid, kind)

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def log_lines(self, needle: str) -> list[str]:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return [line for line in text.splitlines() if needle in line]

    def client(self, timeout_s: float = 60.0) -> httpx.Client:
        return http_client(self.url, timeout_s)

    def __enter__(self) -> ServerProcess:
        return self if self.alive() else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisProcess:
    """A redis-server of the scenario's own on a fixed loopback port. With `durable` every
    write reaches its append-only file (--dir) before Redis answers, so a kill -9 of Redis
    loses nothing it acknowledged (the file is in the OS's hands; `everysec` fsyncs it for a
    machine crash; `always` would fsync each multi-MB KV chunk and slow every turn down):
    the persistence that session records kept in Redis need."""

    def __init__(self, data_dir: Path, durable: bool = True, port: int = 0) -> None:
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.durable = durable
        self.proc: subprocess.Popen | None = None

    @staticmethod
    def binary() -> str | None:
        return shutil.which("redis-server") or (
            "/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None
        )

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 15.0) -> RedisProcess:
        import redis

        binary = self.binary()
        if binary is None:
            raise FileNotFoundError("redis-server is not installed")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        aof = ["--appendonly", "yes", "--appendfsync", "everysec"] if self.durable else []
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir)]
        self.proc = subprocess.Popen(
            [binary, *args, "--save", "", *aof],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_timeout=1, socket_connect_timeout=1)

        def answers() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            try:
                return bool(client.ping())
            except redis.exceptions.RedisError:
                return False

        try:
            wait_until(answers, timeout_s, f"redis-server on port {self.port}")
        finally:
            client.close()
        return self

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()  # a stopped process dies of SIGKILL too, but reaping it is quicker
            self.proc.kill()
            self.proc.wait(10)

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)

    @contextlib.contextmanager
    def hung(self) -> Iterator[None]:
        """Stopped for the block: the kernel still accepts and buffers, nobody answers."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.resume()
        terminate(self.proc)
