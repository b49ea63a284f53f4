"""A session begun on one replica and continued on another through the shared Redis gives what a
recompute of the same token ids gives: the same greedy tokens and, per token, the same
log-probabilities within fp32 noise (issue 37 item 6).

The report behind it: served replicas, B's greedy reply after reading 84 tokens from Redis
differed from a store-off server's. That comparison re-rendered the history through the chat
template, while the session continues from its exact stored token ids; here both sides compute
the same ids, so a difference could only be the restore (the borrowed chunks, the re-RoPE, the
prefill split at the restored boundary). B has no DRAM or SSD tier of its own: everything it
reuses comes up from Redis. fp32, dense weights, a real redis-server.
"""

from __future__ import annotations

import pytest

from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.llm_engine import LLMEngine
from chatstore.engine.request import Request
from chatstore.store.sealing.master_key import new_secret_line
from tests.support.engine import greedy, run_all, tiny_runtime, tokens_of
from tests.support.redis_server import redis_server_binary, start_local_redis
from tests.support.replicas import CHUNK, Replica

pytestmark = pytest.mark.usefixtures("single_thread")

HISTORY = [(7 * i) % 200 + 3 for i in range(2 * CHUNK + 20)]  # two full chunks and a tail
LOGPROB_TOL = 1e-4  # fp32: what another summation order of the same attention moves


def turn(store, engine, rid: str, ids: list[int]):
    """One turn of session "s", opened as the API opens it; its outputs."""
    opened = store.open_turn("t", "s", ids)
    req = Request(rid, list(ids), greedy(6, logprobs=5), tenant="t", session_id="s")
    req.store_turn = opened
    engine.add_request(req)
    outs = run_all(engine)[rid]
    assert store.flush_persist(30)
    return outs


def logprobs_of(outs) -> list:
    return [lp for o in outs for s in o.samples for lp in (s.logprobs or [])]


def test_a_session_continued_on_another_replica_matches_recompute(tmp_path):
    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed")
    redis = start_local_redis(policy="noeviction")
    replicas: list[Replica] = []
    try:
        secret = new_secret_line()  # replicas share one master key; records in the same Redis
        replicas.append(Replica(tmp_path, "a", redis.url, redis.url, secret, 32 * CHUNK * 512))
        replicas.append(Replica(tmp_path, "b", redis.url, redis.url, secret, dram_bytes=0))
        (a_store, a), (b_store, b) = ((r.store, r.engine) for r in replicas)
        first = turn(a_store, a, "t1", HISTORY)
        follow_up = [*HISTORY, *tokens_of(first), *[(5 * i) % 200 + 3 for i in range(30)]]
        before = b_store.tiers.counters.bytes_up
        second = turn(b_store, b, "t2", follow_up)
        reused = second[-1].usage.cached_tokens
        assert reused > 2 * CHUNK  # the chunks and the tail A stored
        assert b_store.tiers.counters.bytes_up - before == reused * b_store.bytes_per_token
        fresh = LLMEngine(tiny_runtime(num_blocks=256), EngineConfig(enable_prefix_cache=False))
        fresh.add_request(Request("r", list(follow_up), greedy(6, logprobs=5)))
        expected = run_all(fresh)["r"]
        assert tokens_of(second) == tokens_of(expected)
        for got, want in zip(logprobs_of(second), logprobs_of(expected), strict=True):
            assert abs(got.logprob - want.logprob) <= LOGPROB_TOL
            assert [t for t, _ in got.top] == [t for t, _ in want.top]
            for (_, g), (_, w) in zip(got.top, want.top, strict=True):
                assert abs(g - w) <= LOGPROB_TOL
    finally:
        for r in replicas:
            r.close()
        redis.stop()
