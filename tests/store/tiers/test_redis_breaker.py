"""Redis outages cost a few short timeouts, then nothing: the circuit breaker takes the remote
tier out, the engine thread never waits on Redis (remote-only chunks are recomputed), and
remote hits resume once Redis answers again. Real redis-servers, hung with SIGSTOP."""

from __future__ import annotations

import hashlib
import threading
import time

import pytest
import torch

from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.llm_engine import LLMEngine
from chatstore.engine.request import Request
from chatstore.engine.runtime import Runtime
from chatstore.store.attention_store import AttentionStore
from chatstore.store.session_kv import ChunkKey, SessionKey, SessionKV
from chatstore.store.settings import StoreSettings
from chatstore.store.tiers.base import TierUnavailable
from chatstore.store.tiers.breaker import CircuitBreaker
from chatstore.store.tiers.chunk_tiers import ChunkTiers
from chatstore.store.tiers.dram import DramTier, TokenKVShape
from chatstore.store.tiers.redis import RedisTier
from chatstore.transfer import StoreConnector
from tests.support.engine import (
    greedy,
    prompt,
    run_alone,
    tiny_runtime,
    tokens_of,
)
from tests.support.redis_faults import hung, kill, redis_sends
from tests.support.store import push_down

pytestmark = pytest.mark.usefixtures("single_thread")

TIMEOUT_S = 0.2
LAYOUT = TokenKVShape(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)


def K(name: str) -> ChunkKey:
    return ChunkKey("t", hashlib.blake2b(name.encode(), digest_size=16).hexdigest())


def value(num_tokens: int, seed: int = 0) -> SessionKV:
    g = torch.Generator().manual_seed(seed)
    return SessionKV(list(range(num_tokens)), torch.randn((2, 2, num_tokens, 2, 4), generator=g))


def sent(fn, monkeypatch) -> tuple[object, int]:
    """fn's result (or the TierUnavailable it raised) and how many commands it sent to Redis."""
    with redis_sends(monkeypatch) as sends:
        try:
            out = fn()
        except TierUnavailable as exc:
            out = exc
    return out, sum(sends.values())


# -- the Redis tier against a real server -----------------------------------------------------


def _tier(server, failures: int = 3, reset_s: float = 5.0) -> RedisTier:
    breaker = CircuitBreaker(failures, reset_s)
    return RedisTier(server.url, 1 << 20, "fp", ttl_s=60, timeout_s=TIMEOUT_S, breaker=breaker)


def test_hung_redis_opens_the_breaker_then_calls_short_circuit(own_redis, monkeypatch):
    tier = _tier(own_redis, failures=3, reset_s=0.5)
    tier.put(K("a"), value(4, seed=1))
    # A loaded machine must not see Redis resumed by hung()'s safety timer mid-block: a bound
    # well past the block's ~1 s (one CI run counted 2 commands in a call; a reconnect's
    # handshake answered after such a resume is the likeliest cause).
    with hung(own_redis, max_s=30):
        for _ in range(3):  # each call gives up after one short timeout, no retries
            out, sends = sent(lambda: tier.get(K("a")), monkeypatch)
            assert isinstance(out, TierUnavailable) and sends == 1
        assert tier.health().state == "open" and tier.health().opens == 1
        for call in (lambda: tier.get(K("a")), lambda: tier.put(K("b"), value(4))):
            out, sends = sent(call, monkeypatch)
            assert isinstance(out, TierUnavailable) and sends == 0  # no socket I/O
        assert not tier.contains(K("a"))  # while open the tier holds nothing
        assert tier.health().short_circuited == 2
    time.sleep(0.5)  # reset_s: the next call probes, Redis answers, the breaker closes
    assert tier.contains(K("a"))
    assert tier.get(K("a")).equal(value(4, seed=1))
    assert tier.health().state == "closed"
    tier.close()


def test_dead_redis_reads_miss_and_the_hierarchy_treats_it_as_absent(own_redis, monkeypatch):
    dram = DramTier(1 << 16, LAYOUT, block_size=4)
    remote = _tier(own_redis, failures=2, reset_s=60)
    tiers = ChunkTiers([dram, remote])
    remote.put(K("cold"), value(4, seed=2))
    tiers.put(K("hot"), value(4, seed=3))
    assert tiers.where(K("cold")) == "remote" and tiers.where(K("hot")) == "dram"
    kill(own_redis)
    for _ in range(2):
        assert tiers.get(K("cold"), promote=False) is None  # refused: a miss, no exception
    assert remote.health().state == "open"
    assert tiers.where(K("cold")) is None  # the remote tier is absent now
    out, sends = sent(lambda: tiers.get(K("cold")), monkeypatch)
    assert out is None and sends == 0
    assert tiers.get(K("hot")).equal(value(4, seed=3))


# -- the store and the engine ------------------------------------------------------------------


def _store(tmp_path, server, **kw) -> tuple[AttentionStore, Runtime]:
    runtime = tiny_runtime(num_blocks=128)
    kw.setdefault("dram_bytes", 1 << 20)
    kw.setdefault("ssd_bytes", 0)
    kw.setdefault("redis_timeout_s", TIMEOUT_S)
    settings = StoreSettings(
        data_dir=tmp_path,
        redis_url=server.url,
        redis_bytes=1 << 20,
        block_size=4,
        chunk_tokens=8,
        persist="off",
        **kw,
    )
    store = AttentionStore(settings, runtime.model.spec, runtime.model.fingerprint)
    return store, runtime


def _admit(conn: StoreConnector, sid: str, ids: list[int], rid: str, opened=None) -> int:
    """The engine thread's admission read of a session (of a turn the API opened: `opened`,
    its handle): the tokens it reuses."""
    req = Request(rid, ids, greedy(1), tenant="t", session_id=sid, store_turn=opened)
    n = conn.num_external_tokens(req, 0)
    conn.forget(rid)
    return n


def _kv(n: int) -> torch.Tensor:
    return torch.randn((2, 2, n, 2, 16))  # the tiny model: [L, 2, T, Hkv, D]


def test_engine_reads_do_not_wait_for_a_save_stuck_on_hung_redis(tmp_path, own_redis):
    """A save (here: a chunk's write to Redis) stuck on hung Redis holds the tiers' I/O lock.
    The engine thread reads host memory only (issue 23): the session only SSD holds is not
    read there (recomputed, and hinted to the prefetch thread), the DRAM one is, and both
    admissions return while the save is still stuck (its client waits up to a minute here, and
    Redis stays hung until the block ends: a read that waited for the lock could only return
    after the save, which the test sees). The API thread that opens the SSD session's turn
    then brings it up, evicting the DRAM session, which lands below."""
    store, runtime = _store(
        tmp_path, own_redis, dram_bytes=2 * 8 * 512, ssd_bytes=1 << 20, redis_timeout_s=60
    )
    conn = StoreConnector(store, runtime.kv_cache, runtime.runner.rope)
    ids = {sid: prompt(seed, 16) for seed, sid in enumerate(("ssd", "dram"))}
    store.save("t", "ssd", SessionKV(ids["ssd"], _kv(16)))
    push_down(store, "t", "ssd")
    store.save("t", "dram", SessionKV(ids["dram"], _kv(16)))  # DRAM is full now
    assert store.tier_of("t", "ssd") == "ssd" and store.tier_of("t", "dram") == "dram"
    remote, shared = store.tier("remote"), SessionKV(list(range(4)), _kv(4))

    def stuck_save() -> None:  # a chunk written to Redis (a delete sends nothing there)
        with store.tiers._io_lock:
            store.tiers._write_down(K("shared"), shared, [remote], drop=False)

    saver = threading.Thread(target=stuck_save, daemon=True)
    with hung(own_redis, max_s=30):
        saver.start()
        _wait_for(store.tiers._io_lock.locked)  # the write waits on Redis, holding the lock
        assert _admit(conn, "ssd", [*ids["ssd"], 7], "r1") == 0  # no disk read here
        assert saver.is_alive(), "the SSD admission returned only after the stuck save"
        assert _admit(conn, "dram", [*ids["dram"], 7], "r2") == 16
        assert saver.is_alive(), "the DRAM read returned only after the stuck save"
    saver.join(30)
    opened = store.open_turn("t", "ssd")  # the API opens its turn: SSD -> DRAM on that thread
    assert _admit(conn, "ssd", [*ids["ssd"], 7], "r3", opened) == 16
    assert store.tiers.drain_background(5)
    assert store.tier_of("t", "dram") == "ssd"  # the evicted session landed below
    store.close()


def _wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _run(engine: LLMEngine, max_steps: int = 1000) -> dict:
    outs: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return outs
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    raise AssertionError("engine did not finish")


def _turn(engine, history: dict[str, list[int]], turn: int) -> dict[str, int]:
    reqs = {}
    for sid, ids in history.items():
        reqs[sid] = Request(f"{sid}{turn}", ids, greedy(4), tenant="t", session_id=sid)
        engine.add_request(reqs[sid])
    outs = _run(engine)
    for sid, req in reqs.items():
        got = tokens_of(outs[req.request_id])
        assert got == run_alone(req), f"session {sid} turn {turn} differs from a recompute"
        history[sid] = [*req.prompt_token_ids, *got, *prompt(100 + turn, 3)]
    return {sid: outs[r.request_id][-1].usage.cached_tokens for sid, r in reqs.items()}


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "sync"])
def test_engine_steps_do_not_wait_on_hung_redis_and_hits_resume(
    tmp_path, own_redis, layerwise, monkeypatch
):
    store, runtime = _store(
        tmp_path, own_redis, async_save=True, redis_breaker_failures=2, redis_breaker_reset_s=0.5
    )
    conn = StoreConnector(store, runtime.kv_cache, runtime.runner.rope)
    conn.layerwise = layerwise
    engine = LLMEngine(runtime, EngineConfig(enable_prefix_cache=False), conn)
    history = {sid: prompt(seed, 20) for seed, sid in enumerate(("hot", "cold"))}
    _turn(engine, history, 0)
    store.flush_writes()
    push_down(store, "t", "cold")  # its chunks only in Redis
    engine_thread = threading.current_thread().name  # engine.step() runs on this thread
    with hung(own_redis), redis_sends(monkeypatch) as sends:
        cached = _turn(engine, history, 1)
        assert sends[engine_thread] == 0, f"the engine thread sent to hung Redis: {sends}"
        assert cached["hot"] > 0 and cached["cold"] == 0  # remote-only: recomputed
        _wait_for(lambda: store.stats().remote.state == "open")  # the prefetch hint's reads
    time.sleep(0.5)  # reset_s: Redis is probed again
    _turn(engine, history, 2)  # the admission hints a prefetch of what Redis alone holds
    store.flush_writes()
    chain = store.index.get(SessionKey("t", "cold"))
    _wait_for(lambda: all(store.tiers.where(c) == "dram" for c in chain.chunks))
    cached = _turn(engine, history, 3)
    assert cached["cold"] > 0 and store.stats().remote.state == "closed"
    store.close()


def test_breaker_state_is_in_stats_admin_and_metrics(tmp_path, own_redis):
    from prometheus_client import generate_latest

    from chatstore.api.admin.metrics import RemoteBreakerCollector
    from chatstore.store.ports import ContextBudget
    from chatstore.store.session_store import SessionStore

    store, _ = _store(tmp_path, own_redis, redis_breaker_failures=1, redis_breaker_reset_s=60)
    adapter = SessionStore(store.records, store)
    assert adapter.remote_health() == {
        "state": "closed", "failures": 0, "opens": 0, "short_circuited": 0, "last_error": None,
    }  # fmt: skip
    store.tier("remote").put(K("a"), SessionKV(list(range(4)), _kv(4)))
    with hung(own_redis):
        assert store.tiers.get(K("a"), promote=False) is None  # one timeout: open
        assert store.tiers.get(K("a"), promote=False) is None  # absent now: not even asked
    health = adapter.remote_health()
    assert health["state"] == "open" and health["opens"] == 1 and health["failures"] == 1
    assert "Timeout" in health["last_error"]
    assert store.stats().as_dict()["remote"] == health
    text = generate_latest(RemoteBreakerCollector(adapter.remote_health)).decode()
    assert "chatstore_remote_breaker_open 1.0" in text
    assert "chatstore_remote_breaker_opens_total 1.0" in text
    assert "chatstore_remote_short_circuited_total" in text
    assert SessionStore(object(), context=ContextBudget(2048)).remote_health() is None
    store.close()
