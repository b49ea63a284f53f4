"""Replicas for tests, two kinds.

In process (`Replica`; the `kv_redis` and `records_redis` fixtures are tests/store/conftest.py's):
one server's AttentionStore and tiny engine over a shared KV Redis, several in one test
(tests/store/: tiers/test_shared_tier.py, sealing/test_replica_keys.py,
test_replica_continuation.py), which differ in their DRAM tier's size.

As processes (`ReplicaCluster`): several chatstore replicas behind nginx on a Redis Cluster, all
on loopback: the topology of deploy/cluster.sh, in Python so that tests and bench/replicas.py
need no bash parsing. Both render the same deploy/nginx.conf.template. Every wait is bounded.

    with ReplicaCluster(tmp, replicas=2).start() as cluster:
        httpx.post(cluster.proxy_url + "/v1/sessions", json={})
        cluster.replicas[0].kill9()

               ┌─► replica r0 ─┐
    client ─► nginx (hash on session) ─► replica r1 ─┼─► Redis Cluster (3 masters)
               └─► ...         ┘        records, KV chunks, leases
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any, NamedTuple

import torch

from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.llm_engine import LLMEngine
from chatstore.engine.request import Request
from chatstore.store.attention_store import AttentionStore
from chatstore.store.sealing.master_key import new_secret_line
from chatstore.store.session_kv import ChunkKey, SessionKey, SessionKV
from chatstore.store.settings import StoreSettings
from chatstore.transfer import StoreConnector
from tests.chaos.harness import (
    RedisProcess,
    ServerProcess,
    http_client,
    terminate,
    wait_until,
)
from tests.support.engine import greedy, run_all, run_alone, tiny_runtime, tokens_of
from tests.support.redis_server import (
    start_local_redis,
    start_local_redis_cluster,
)

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "deploy" / "nginx.conf.template"
AFFINE = "hash $chatstore_session consistent;"
ROUND_ROBIN = ""


# -- in process: stores and tiny engines over one shared KV Redis ---------------------------------

CHUNK = 64  # tokens per stored chunk: 32 KiB of the tiny model's fp32 KV


class Turn(NamedTuple):
    tokens: list[int]
    cached: int


class Replica:
    """One server's store and engine over the shared KV Redis (no LMDB tier): `dram_bytes` of
    DRAM tier (0: every read of a stored chunk goes to Redis); `redis_bytes`, the Redis tier's
    planning capacity (None: StoreSettings' default), is no budget: Redis's maxmemory evicts."""

    def __init__(
        self,
        tmp_path: Path,
        name: str,
        kv_url: str,
        records_url: str,
        secret: str,
        dram_bytes: int,
        redis_bytes: int | None = None,
    ) -> None:
        self.runtime = tiny_runtime(num_blocks=256)
        spec, fingerprint = self.runtime.model.spec, self.runtime.model.fingerprint
        settings = StoreSettings(
            data_dir=tmp_path / name,
            dram_bytes=dram_bytes,
            ssd_bytes=0,
            redis_url=kv_url,
            records_url=records_url,
            block_size=4,
            chunk_tokens=CHUNK,
            persist="write_through",
            secret_key=secret,
        )
        if redis_bytes is not None:
            settings = dataclasses.replace(settings, redis_bytes=redis_bytes)
        self.store = AttentionStore(settings, spec, fingerprint)
        self.conn = StoreConnector(self.store, self.runtime.kv_cache, self.runtime.runner.rope)
        self.engine = LLMEngine(self.runtime, EngineConfig(enable_prefix_cache=False), self.conn)
        self._n = 0

    def turn(self, tenant: str, sid: str, ids: list[int]) -> Turn:
        """One acknowledged turn (saved before it returns), checked against a fresh run's
        greedy tokens: its tokens and cached token count."""
        opened = self.store.open_turn(tenant, sid)  # what the API does when it opens a turn
        self._n += 1
        req = Request(f"{sid}-{self._n}", list(ids), greedy(4), tenant=tenant, session_id=sid)
        req.store_turn = opened
        self.engine.add_request(req)
        outs = run_all(self.engine)[req.request_id]
        assert self.store.flush_persist(30)
        got = tokens_of(outs)
        assert got == run_alone(req), f"{sid}: differs from a fresh run"
        return Turn(got, outs[-1].usage.cached_tokens)

    def load(
        self, tenant: str, prefix: str, sessions: int, tokens: int, seed: int
    ) -> list[SessionKey]:
        """Sessions saved directly (random KV): pressure on the shared tier."""
        keys = []
        for i in range(sessions):
            g = torch.Generator().manual_seed(seed + i)
            ids = torch.randint(2, 256, (tokens,), generator=g).tolist()
            self.store.save(
                tenant,
                f"{prefix}{i}",
                SessionKV(ids, torch.randn(2, 2, tokens, 2, 16, generator=g)),
            )
            keys.append(SessionKey(tenant, f"{prefix}{i}"))
        assert self.store.flush_persist(30)
        return keys

    def chunks(self, tenant: str, sid: str) -> list[ChunkKey]:
        chain = self.store.index.get(SessionKey(tenant, sid))
        assert chain is not None
        return list(chain.chunks)

    def open_failures(self) -> int:
        return self.store.open_failures().get("remote", 0)

    def close(self) -> None:
        self.store.close(flush_dram=False)


# -- as processes: `chatstore serve` replicas behind nginx ----------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def render_nginx(listen: str, servers: list[str], balance: str = AFFINE) -> str:
    upstream = " ".join(f"server {s} max_fails=1 fail_timeout=5s;" for s in servers)
    text = TEMPLATE.read_text()
    for key, value in (
        ("@LISTEN@", listen),
        ("@BALANCE@", balance),
        ("@UPSTREAM_SERVERS@", upstream),
    ):
        text = text.replace(key, value)
    return text


class NginxProcess:
    def __init__(self, work: Path, servers: list[str], balance: str = AFFINE) -> None:
        self.dir = Path(work)
        self.port = free_port()
        self.servers = servers
        self.balance = balance
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> NginxProcess:
        self.dir.mkdir(parents=True, exist_ok=True)
        conf = self.dir / "nginx.conf"
        conf.write_text(render_nginx(f"127.0.0.1:{self.port}", self.servers, self.balance))
        binary = shutil.which("nginx") or "/usr/sbin/nginx"
        globals_ = f"daemon off; pid {self.dir / 'nginx.pid'};"
        cmd = [binary, "-e", "stderr", "-p", str(self.dir), "-c", str(conf), "-g", globals_]
        log = open(self.dir / "nginx.log", "ab")  # noqa: SIM115 (the child holds it)
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log)

        def listening() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited:\n{(self.dir / 'nginx.log').read_text()}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), 0.5),
            ):
                return True
            return False

        wait_until(listening, timeout_s, f"nginx on {self.port}")
        return self

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc)


# Small pools, and KV chunks of 64 tokens so that short test conversations complete chunks.
REPLICA_ENV = {
    "CHATSTORE_CHUNK_TOKENS": "64",
    "CHATSTORE_KV_CACHE_BYTES": str(128 << 20),
    "CHATSTORE_PERSIST_LAG_S": "0.2",
}


class ReplicaCluster:
    """N `chatstore serve` replicas (own data dir, port, replica id) sharing one Redis Cluster
    for KV (allkeys-lru, as deploy/redis-kv.conf) and one Redis for the session records
    (noeviction, records_url: as deploy/cluster.sh), and an nginx for each balance mode asked
    for (affine by default)."""

    def __init__(
        self,
        work: Path,
        replicas: int = 2,
        env: dict[str, str] | None = None,
        balances: tuple[str, ...] = (AFFINE,),
        redis_cluster: bool = True,
    ) -> None:
        self.work = Path(work)
        self.redis_cluster = redis_cluster
        self.n = replicas
        # Replicas share one server secret (encryption at rest): each would otherwise make its
        # own in its data dir and could not open what the others sealed in Redis.
        shared_secret = {"CHATSTORE_SECRET_KEY": new_secret_line("k1")}
        self.env = {**REPLICA_ENV, **shared_secret, **(env or {})}
        self.balances = balances
        self.redis: Any = None
        self.records_redis: Any = None
        self.replicas: list[ServerProcess] = []
        self.proxies: list[NginxProcess] = []

    @property
    def proxy_url(self) -> str:
        return self.proxies[0].url

    def start(self) -> ReplicaCluster:
        try:
            if self.redis_cluster:
                self.redis = start_local_redis_cluster(masters=3)
            else:  # one Redis: the baseline bench/replicas.py compares the cluster with
                self.redis = RedisProcess(self.work / "redis").start()
            self.records_redis = start_local_redis(policy="noeviction")
            for i in range(self.n):
                env = {
                    **self.env,
                    "CHATSTORE_REDIS_URL": self.redis.url,
                    "CHATSTORE_RECORDS_URL": self.records_redis.url,
                    "CHATSTORE_REPLICA_ID": f"r{i}",
                }
                self.replicas.append(ServerProcess(self.work / f"r{i}" / "data", env))
            for replica in self.replicas:  # one at a time: 2 cores
                replica.start()
            servers = [f"127.0.0.1:{r.port}" for r in self.replicas]
            for j, balance in enumerate(self.balances):
                self.proxies.append(NginxProcess(self.work / f"nginx{j}", servers, balance).start())
        except BaseException:
            self.stop()
            raise
        return self

    def replica_at(self, upstream: str) -> ServerProcess:
        """The replica that served a response, from nginx's X-Upstream ("a, b": the last)."""
        last = upstream.split(",")[-1].strip()
        return next(r for r in self.replicas if last == f"127.0.0.1:{r.port}")

    def stop(self) -> None:
        for proxy in self.proxies:
            proxy.stop()
        for replica in self.replicas:
            with contextlib.suppress(Exception):
                replica.stop(30.0)
        if self.redis is not None:
            self.redis.stop()
        if self.records_redis is not None:
            self.records_redis.stop()

    def client(self, timeout_s: float = 60.0) -> Any:
        return http_client(self.proxy_url, timeout_s)

    def __enter__(self) -> ReplicaCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
