"""Throwaway local `redis-server`s for tests and benchmarks (test scaffolding, not part of the
product): free loopback ports, no persistence.

`start_local_redis` starts one server; `start_local_redis_cluster` a Redis Cluster of several;
`LocalRedis.stop` also stops support/redis_tls.py's TLS server.

Eviction as deploy/redis-kv.conf sets it for the KV tier: `maxmemory-policy allkeys-lru` (Redis
owns eviction of the shared tier); `maxmemory` 0 (no limit) unless a test asks for one. A
records server (`start_local_redis(policy="noeviction")`) never evicts."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field


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


KV_POLICY = "allkeys-lru"  # deploy/redis-kv.conf's


def start_local_redis(
    timeout_s: float = 10.0, maxmemory: int = 0, policy: str = KV_POLICY
) -> LocalRedis:
    """Start `redis-server` on 127.0.0.1:<free port> and wait until it answers PING;
    maxmemory bytes (0: no limit) under `policy`."""
    binary = redis_server_binary()
    if binary is None:
        raise FileNotFoundError("redis-server is not installed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly"]
    args += ["no", "--maxmemory", str(maxmemory), "--maxmemory-policy", policy]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = LocalRedis(port, process)
    try:
        _wait_for_ping(port, timeout_s)
    except RuntimeError:
        server.stop()
        raise
    return server


def _wait_for_ping(port: int, timeout_s: float) -> None:
    import redis

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if redis.Redis(port=port, socket_timeout=1).ping():
                return
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError(f"redis-server did not start on port {port}")


def _free_ports(n: int) -> list[int]:
    # Held open together so the n ports differ; cluster bus ports are port + 10000, so keep
    # them below 55536.
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            port = s.getsockname()[1]
            if port < 55536:
                ports.append(port)
    finally:
        for s in socks:
            s.close()
    return ports


@dataclass
class LocalRedisCluster:
    """Masters first (`masters` of them), then their replicas; one redis-server per port."""

    ports: list[int]
    masters: int
    workdir: str
    processes: dict[int, subprocess.Popen] = field(default_factory=dict)

    @property
    def url(self) -> str:
        nodes = ",".join(f"127.0.0.1:{p}" for p in self.ports[: self.masters])
        return f"redis+cluster://{nodes}"

    def spawn(self, port: int) -> None:
        """Start (or restart, with its nodes.conf: same node id, same slots) the node on port."""
        binary = redis_server_binary()
        if binary is None:
            raise FileNotFoundError("redis-server is not installed")
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--cluster-enabled", "yes", "--dir", self.workdir]
        args += ["--maxmemory-policy", KV_POLICY]
        args += ["--cluster-config-file", f"nodes-{port}.conf", "--cluster-node-timeout", "1000"]
        # A replica that never finished its first sync does not take over; the default 5 s
        # diskless-sync delay would leave a fresh cluster with unsynced replicas that long.
        args += ["--repl-diskless-sync-delay", "0", "--logfile", f"{self.workdir}/{port}.log"]
        self.processes[port] = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        _wait_for_ping(port, 10.0)

    def master_ports(self) -> list[int]:
        """The ports of the masters now serving slots (after a failover, promoted replicas)."""
        import redis

        live = next(iter(self.processes))
        raw = redis.Redis(port=live, socket_timeout=1).execute_command("CLUSTER", "NODES")
        text = raw.decode() if isinstance(raw, bytes) else raw
        ports = []
        for line in text.splitlines():
            fields = line.split()
            if "master" in fields[2] and "fail" not in fields[2] and len(fields) > 8:
                ports.append(int(fields[1].split("@")[0].rsplit(":", 1)[1]))
        return sorted(ports)

    def kill(self, port: int) -> None:
        """SIGKILL: the node vanishes mid-run, as in a crash."""
        process = self.processes.pop(port)
        process.kill()
        process.wait()

    def info(self, port: int) -> dict[str, str]:
        import redis

        raw = redis.Redis(port=port, socket_timeout=1).execute_command("CLUSTER", "INFO")
        text = raw.decode() if isinstance(raw, bytes) else raw
        return dict(line.split(":", 1) for line in text.split() if ":" in line)

    def wait_ok(self, timeout_s: float = 20.0) -> None:
        """Until every live node says cluster_state:ok."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if all(self.info(p)["cluster_state"] == "ok" for p in self.processes):
                    return
            except Exception:  # a node still starting: try again
                pass
            time.sleep(0.1)
        raise RuntimeError("Redis Cluster did not reach cluster_state:ok")

    def wait_synced(self, timeout_s: float = 20.0) -> None:
        """Until every live replica's link to its master is up."""
        import redis

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            infos = [
                redis.Redis(port=p, socket_timeout=1).info("replication") for p in self.processes
            ]
            if all(i["role"] == "master" or i.get("master_link_status") == "up" for i in infos):
                return
            time.sleep(0.1)
        raise RuntimeError("Redis Cluster replicas did not sync")

    def stop(self) -> None:
        # SIGKILL, not SIGTERM: nothing is persisted, and a cluster master's clean shutdown
        # waits for its replicas to catch up (seconds per node).
        for port in list(self.processes):
            self.kill(port)
        shutil.rmtree(self.workdir, ignore_errors=True)


def start_local_redis_cluster(masters: int = 3, replicas: int = 0) -> LocalRedisCluster:
    """`masters` masters (each with `replicas` replicas) on free loopback ports, slots split by
    `redis-cli --cluster create`; returns once every node says cluster_state:ok. A 1 s node
    timeout makes a replica take over a killed master in about 2 s."""
    ports = _free_ports(masters * (1 + replicas))
    cluster = LocalRedisCluster(ports, masters, tempfile.mkdtemp(prefix="chatstore-cluster-"))
    try:
        for port in ports:
            cluster.spawn(port)
        cli = shutil.which("redis-cli") or "/usr/bin/redis-cli"
        create = [cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports)]
        subprocess.run(
            [*create, "--cluster-replicas", str(replicas), "--cluster-yes"],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=30,
        )
        cluster.wait_ok()
        cluster.wait_synced()
    except BaseException:
        cluster.stop()
        raise
    return cluster
