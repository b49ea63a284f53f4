"""A new session reuses the stored chunks its prompt begins with, on any replica (issue 23).

Chunk keys are content-addressed (tenant, model, every token before), so a system prompt that
one session stored hashes to the same keys for every session of the tenant that sends it. A
session with no chain of its own borrows those chunks when its turn opens
(TurnOpening._borrow): from this replica's tiers, or through the shared Redis from another
replica's. Real engines (the tiny model, no device prefix cache: the store's path alone), a
real redis-server; every turn's greedy tokens are checked against a fresh run.
"""

from __future__ import annotations

import time

import pytest
import redis as redis_lib

from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.llm_engine import LLMEngine
from chatstore.engine.request import Request
from chatstore.store.attention_store import AttentionStore
from chatstore.store.sealing.master_key import new_secret_line
from chatstore.store.session_kv import SessionKey
from chatstore.store.settings import StoreSettings
from chatstore.transfer import StoreConnector
from tests.support.engine import greedy, run_all, run_alone, tiny_runtime, tokens_of
from tests.support.redis_server import redis_server_binary, start_local_redis

pytestmark = pytest.mark.usefixtures("single_thread")

CHUNK = 64
SYSTEM = [(7 * i) % 200 + 3 for i in range(3 * CHUNK + 20)]  # 3 full chunks and a part


def user(seed: int) -> list[int]:
    return [(seed * 13 + 5 * i) % 200 + 3 for i in range(30)]


class Server:
    """One replica's store and engine (Redis shared when a URL is given)."""

    def __init__(
        self,
        tmp_path,
        name: str,
        redis_url: str | None = None,
        secret: str = "",
        persist: str = "write_through",
    ) -> None:
        self.runtime = tiny_runtime(num_blocks=256)
        spec, fingerprint = self.runtime.model.spec, self.runtime.model.fingerprint
        settings = StoreSettings(
            data_dir=tmp_path / name,
            dram_bytes=32 * CHUNK * 512,
            ssd_bytes=0 if redis_url else 64 << 20,
            redis_url=redis_url,
            records_url=redis_url,
            block_size=4,
            chunk_tokens=CHUNK,
            persist=persist,
            persist_lag_s=30.0,  # write_back: nothing reaches Redis by the lag in this test
            secret_key=secret,
        )
        self.store = AttentionStore(settings, spec, fingerprint)
        self.conn = StoreConnector(self.store, self.runtime.kv_cache, self.runtime.runner.rope)
        self.engine = LLMEngine(self.runtime, EngineConfig(enable_prefix_cache=False), self.conn)
        self._n = 0

    def turn(self, tenant: str, sid: str, ids: list[int], flush: bool = True) -> int:
        """One turn opened as the API opens it (with its prompt); the cached tokens. Its
        greedy tokens must equal a fresh run's."""
        opened = self.store.open_turn(tenant, sid, ids)
        self._n += 1
        req = Request(f"{sid}-{self._n}", list(ids), greedy(4), tenant=tenant, session_id=sid)
        req.store_turn = opened
        self.engine.add_request(req)
        outs = run_all(self.engine)[req.request_id]
        assert self.store.flush_persist(30) if flush else self.store.flush_writes(30)
        assert tokens_of(outs) == run_alone(req), f"{sid}: differs from a fresh run"
        return outs[-1].usage.cached_tokens

    def chunks(self, tenant: str, sid: str) -> list:
        chain = self.store.index.get(SessionKey(tenant, sid))
        assert chain is not None
        return list(chain.chunks)

    def close(self) -> None:
        self.store.close(flush_dram=False)


def test_new_session_borrows_the_shared_prompt_on_the_same_store(tmp_path):
    server = Server(tmp_path, "one")
    try:
        assert server.turn("t", "first", SYSTEM + user(1)) == 0
        shared = (len(SYSTEM) // CHUNK) * CHUNK  # the full chunks the two prompts share
        # No device prefix cache: the KV comes from the store's DRAM tier.
        assert server.turn("t", "second", SYSTEM + user(2)) == shared
        # Its commit references the borrowed chunks as its own: the first session's delete
        # leaves them stored for it.
        borrowed = server.chunks("t", "first")[: shared // CHUNK]
        assert server.chunks("t", "second")[: shared // CHUNK] == borrowed
        assert server.store.delete_session("t", "first")
        assert all(server.store.tiers.contains(c) for c in borrowed)
        assert server.turn("t", "third", SYSTEM + user(3)) == shared
        # Another tenant sends the same prompt: its keys differ, nothing is shared.
        assert server.turn("u", "other", SYSTEM + user(4)) == 0
        # A prompt shorter than one chunk borrows nothing, and still runs.
        assert server.turn("t", "short", SYSTEM[: CHUNK - 1]) == 0
    finally:
        server.close()


def test_a_session_on_another_replica_borrows_the_shared_prompt_through_redis(tmp_path):
    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed")
    redis = start_local_redis(policy="noeviction")
    a = b = None
    try:
        secret = new_secret_line()  # replicas share one (encryption at rest)
        a = Server(tmp_path, "a", redis.url, secret)
        b = Server(tmp_path, "b", redis.url, secret)
        assert a.turn("t", "on-a", SYSTEM + user(1)) == 0
        shared = (len(SYSTEM) // CHUNK) * CHUNK
        # A reuses the prompt from its own DRAM: Redis serves no read, yet the chunks' LRU
        # clock moves (refresh_shared), so allkeys-lru does not take a prompt in use first.
        prompt = a.chunks("t", "on-a")[: shared // CHUNK]
        names = [a.store.tier("remote")._name(c) for c in prompt]
        kv = redis_lib.Redis.from_url(redis.url)
        time.sleep(2.2)
        assert all(kv.object("idletime", n) >= 2 for n in names)
        assert a.turn("t", "again-on-a", SYSTEM + user(5)) == shared
        assert all(kv.object("idletime", n) <= 1 for n in names)
        before = b.store.tiers.counters.bytes_up
        # B has seen no prompt yet: every reused token is A's chunks, read from Redis.
        assert b.turn("t", "on-b", SYSTEM + user(2)) == shared
        came_up = b.store.tiers.counters.bytes_up - before
        assert came_up == shared * b.store.bytes_per_token
        assert b.chunks("t", "on-b")[: shared // CHUNK] == a.chunks("t", "on-a")[: shared // CHUNK]
        assert b.turn("u", "other-tenant", SYSTEM + user(3)) == 0
    finally:
        for server in (a, b):
            if server is not None:
                server.close()
        redis.stop()


@pytest.fixture
def write_back(tmp_path):
    """A server with write-back (a 30 s lag: nothing reaches Redis by it in these tests), its
    Redis client and its Redis tier."""
    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed")
    redis = start_local_redis(policy="noeviction")
    server = None
    try:
        server = Server(tmp_path, "a", redis.url, new_secret_line(), persist="write_back")
        yield server, redis_lib.Redis.from_url(redis.url), server.store.tier("remote")
    finally:
        if server is not None:
            server.close()
        redis.stop()


def test_a_shared_prompt_reaches_redis_before_its_write_back(write_back):
    """Write-back defers copies to idle moments: a burst of new sessions would leave the
    prompt they share in DRAM only, to be written to Redis after their own tails (older to
    Redis's LRU). The second session that reuses it sends it to Redis at its commit; a chunk
    one session alone holds waits for its write-back."""
    server, kv, remote = write_back
    assert server.turn("t", "first", SYSTEM + user(1), flush=False) == 0
    first = server.chunks("t", "first")
    assert not any(kv.exists(remote._name(c)) for c in first)  # waiting for write-back
    shared = (len(SYSTEM) // CHUNK) * CHUNK
    assert server.turn("t", "second", SYSTEM + user(2), flush=False) == shared
    prompt, tail = first[: shared // CHUNK], first[shared // CHUNK :]
    assert all(kv.exists(remote._name(c)) for c in prompt)
    assert not any(kv.exists(remote._name(c)) for c in tail)


def test_shared_chunks_are_touched_before_each_write_back_copy(write_back):
    """Write-back copies a burst's chunks to Redis later. Just before each copy the shared
    chunks turns reused lately are touched (SharedWarmth), so the prompt every session uses
    from DRAM is never older to Redis's LRU than the tails landing (OBJECT IDLETIME: Redis's
    own clock, one-second resolution)."""
    server, kv, remote = write_back
    server.turn("t", "s0", SYSTEM + user(0), flush=False)
    server.turn("t", "s1", SYSTEM + user(1))  # the prompt in Redis, every copy done
    for i in range(2, 5):  # three more sessions: their tails wait for write-back
        server.turn("t", f"s{i}", SYSTEM + user(i), flush=False)
    shared = len(SYSTEM) // CHUNK
    prompt = [remote._name(c) for c in server.chunks("t", "s0")[:shared]]
    tails = [remote._name(server.chunks("t", f"s{i}")[shared]) for i in range(2, 5)]
    assert not any(kv.exists(n) for n in tails)
    time.sleep(2.2)
    assert all(kv.object("idletime", n) >= 2 for n in prompt)
    assert server.store.flush_persist(30)  # the tails land
    assert all(kv.exists(n) for n in tails)
    assert all(kv.object("idletime", n) <= 1 for n in prompt)
