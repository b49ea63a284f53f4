"""The read buffer under faults: a staging the budget refuses holds nothing, and a client's hint
whose lookup hangs (its session's KV on a hung Redis) never holds up the engine thread: not a
layer-wise load of another session, nor the hinted session's own turn."""

from __future__ import annotations

import time

import pytest
import torch

from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.llm_engine import LLMEngine
from chatstore.engine.request import Request
from chatstore.store.attention_store import AttentionStore
from chatstore.store.session_kv import SessionKey, SessionKV
from chatstore.store.session_store import SessionStore
from chatstore.store.settings import StoreSettings
from chatstore.transfer import StoreConnector
from tests.support.engine import (
    assert_pool_clean,
    greedy,
    prompt,
    run_alone,
    tiny_runtime,
    tokens_of,
)
from tests.support.redis_faults import hung
from tests.support.store import push_down

pytestmark = pytest.mark.usefixtures("single_thread")


def _connector(tmp_path, redis_url: str = "", buffer_bytes: int = 512 << 20, **store_kw):
    runtime = tiny_runtime(num_blocks=128)
    settings = StoreSettings(
        data_dir=tmp_path,
        dram_bytes=1 << 20,
        ssd_bytes=0,
        redis_url=redis_url,
        redis_bytes=1 << 20,
        block_size=4,
        chunk_tokens=8,
        persist="off",
        **{"redis_timeout_s": 0.2, **store_kw},
    )
    store = AttentionStore(settings, runtime.model.spec, runtime.model.fingerprint)
    conn = StoreConnector(
        store,
        runtime.kv_cache,
        runtime.runner.rope,
        read_buffer_layers=2,
        read_buffer_bytes=buffer_bytes,
        stage_queued=False,  # hints only
    )
    return runtime, store, conn


def _wait_looked_up(conn: StoreConnector, sid: str):
    entry = conn.read_buffer._entries[SessionKey("t", sid)]
    assert entry.looked_up.wait(5), "the lookup never finished"
    return entry


def test_a_staging_the_budget_refuses_holds_nothing(tmp_path):
    _, store, conn = _connector(tmp_path, buffer_bytes=64 << 10)
    big = SessionKV(list(range(256)), torch.randn((2, 2, 256, 2, 16)))  # 128 KiB saved
    store.save("t", "big", big)
    small = SessionKV(list(range(8)), torch.randn((2, 2, 8, 2, 16)))
    store.save("t", "small", small)
    assert conn.stage("t", "big")
    entry = _wait_looked_up(conn, "big")
    assert entry.saved is None and entry.cancelled  # not the session's whole KV, uncounted
    assert len(conn.read_buffer) == 0 and conn.read_buffer.used_bytes() == 0
    assert conn.stage("t", "small")  # the budget is free for what fits
    entry = _wait_looked_up(conn, "small")
    assert entry.saved is not None and conn.read_buffer.used_bytes() == entry.nbytes > 0
    store.close()


def _turns(engine: LLMEngine, reqs: list[Request]) -> tuple[dict, list[float]]:
    for req in reqs:
        engine.add_request(req)
    outs: dict[str, list] = {}
    steps: list[float] = []
    for _ in range(1000):
        if not engine.has_work():
            break
        t0 = time.perf_counter()
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        steps.append(time.perf_counter() - t0)
    for req in reqs:
        assert tokens_of(outs[req.request_id]) == run_alone(req), req.request_id
    return outs, steps


# A lookup on the hung Redis waits out this timeout (each call): a step that waited for one would
# be at least this much longer than a normal step. The bound below is half of it, a liveness
# bound that no CPU's noise reaches (a step of the tiny model takes milliseconds).
LOOKUP_TIMEOUT_S = 2.0
STALL_BOUND_S = LOOKUP_TIMEOUT_S / 2


def test_a_hint_whose_lookup_hangs_on_redis_stalls_no_engine_step(tmp_path, own_redis):
    # A breaker that stays closed: every lookup of the hinted session waits out its timeouts.
    runtime, store, conn = _connector(
        tmp_path,
        own_redis.url,
        async_save=True,
        redis_breaker_failures=100,
        redis_timeout_s=LOOKUP_TIMEOUT_S,
    )
    engine = LLMEngine(runtime, EngineConfig(enable_prefix_cache=False), conn)
    adapter = SessionStore(store.records, store)  # the connector is the store's hint listener
    first = {sid: prompt(seed, 20) for seed, sid in enumerate(("hot", "cold"))}
    reqs = [Request(f"{s}0", ids, greedy(4), tenant="t", session_id=s) for s, ids in first.items()]
    outs, normal = _turns(engine, reqs)
    store.flush_writes()
    push_down(store, "t", "cold")  # its KV only in Redis
    second = {r.session_id: [*r.prompt_token_ids, *tokens_of(outs[r.request_id]), 9] for r in reqs}
    key = SessionKey("t", "cold")
    with hung(own_redis, max_s=6 * LOOKUP_TIMEOUT_S):
        adapter.hint("t", "cold")  # the client is typing: store prefetch + staging
        entry = conn.read_buffer._entries[key]
        time.sleep(0.05)  # the lookup is waiting on Redis
        hot = Request("hot1", second["hot"], greedy(4), tenant="t", session_id="hot")
        outs, steps = _turns(engine, [hot])  # a layer-wise load from DRAM meanwhile
        assert max(steps) < max(normal) + STALL_BOUND_S, f"a step took {max(steps):.2f} s"
        assert outs["hot1"][-1].usage.cached_tokens > 0
        assert engine.stats().load.kv_layerwise_loads > 0
        # Redis out of reach: nothing
        assert entry.looked_up.wait(3 * LOOKUP_TIMEOUT_S) and entry.saved is None
        adapter.hint("t", "cold")  # again, and the hinted session's turn comes now
        entry = conn.read_buffer._entries[key]
        time.sleep(0.05)
        assert not entry.looked_up.is_set()  # its lookup is in progress, on Redis
        cold = Request("cold1", second["cold"], greedy(4), tenant="t", session_id="cold")
        outs, steps = _turns(engine, [cold])
        assert max(steps) < max(normal) + STALL_BOUND_S, f"a step took {max(steps):.2f} s"
        assert outs["cold1"][-1].usage.cached_tokens == 0  # recomputed, not waited for
    assert_pool_clean(engine)
    store.close()
