"""The read buffer of layer-wise pre-load (CachedAttention Fig. 6(c)): the sessions queued next
(or hinted) are looked up and their first layers staged, rotated, before their job starts.

With a tier made slow (a delay per layer read from it), staged layers cost the forward no read
of that tier: the layers read from it fall with the buffer's size, and the outputs stay those
of a recompute."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
import torch

from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.llm_engine import LLMEngine
from chatstore.engine.request import Request
from chatstore.store.attention_store import AttentionStore
from chatstore.store.session_kv import SessionKey, SessionKV
from chatstore.store.settings import StoreSettings
from chatstore.transfer import StoreConnector, layer_copy
from chatstore.transfer.chunked_kv import ChunkedKV
from chatstore.transfer.read_buffer import ReadBuffer
from tests.support.engine import (
    assert_pool_clean,
    greedy,
    prompt,
    run_all,
    run_alone,
    tiny_runtime,
    tokens_of,
)
from tests.support.store import lookup

pytestmark = pytest.mark.usefixtures("single_thread")

DELAY_S = 0.05


def _engine(tmp_path, read_buffer_layers: int, max_running: int = 32, delay_s: float = DELAY_S):
    runtime = tiny_runtime(num_blocks=128)
    settings = StoreSettings(data_dir=tmp_path, dram_bytes=1 << 20, ssd_bytes=1 << 22, block_size=4)
    store = AttentionStore(settings, runtime.model.spec, runtime.model.fingerprint)
    conn = StoreConnector(
        store,
        runtime.kv_cache,
        runtime.runner.rope,
        layer_delay_s=delay_s,
        read_buffer_layers=read_buffer_layers,
        stage_queued=True,  # the default on a CPU host: hints only
    )
    config = EngineConfig(enable_prefix_cache=False, max_running=max_running)
    return LLMEngine(runtime, config, conn), store, conn


def _first_turn(engine, sid: str, seed: int) -> list[int]:
    """Run a session's first turn; the prompt of its second."""
    history = prompt(seed, 12 + seed)
    req = Request(f"{sid}-0", history, greedy(5), tenant="t", session_id=sid)
    engine.add_request(req)
    out = tokens_of(run_all(engine)[req.request_id])
    return [*history, *out, *prompt(90 + seed, 4)]


def _wait_staged(conn: StoreConnector, sid: str, layers: int, timeout: float = 10.0) -> None:
    entry = conn.read_buffer._entries[SessionKey("t", sid)]
    deadline = time.monotonic() + timeout
    while entry.num_staged_layers < layers:
        assert time.monotonic() < deadline, "staging never finished"
        time.sleep(0.005)


def test_staged_layers_cut_the_wait_and_keep_the_output(tmp_path, monkeypatch):
    store_reads = {}  # layers the turn's load read from the (slow) store tier, per buffer size
    for layers in (0, 1, 2):  # the tiny model has 2 layers: none, half, all of them staged
        engine, store, conn = _engine(tmp_path / str(layers), layers)
        second = _first_turn(engine, "a", 1)
        store.flush_writes()
        if layers:
            assert conn.stage("t", "a")  # the client's hint ("typing")
            _wait_staged(conn, "a", layers)
        req = Request("a-1", second, greedy(5), tenant="t", session_id="a")
        engine.add_request(req)
        with counted_layer_reads(monkeypatch) as reads:
            outs = run_all(engine)
        store_reads[layers] = reads[0]
        assert tokens_of(outs["a-1"]) == run_alone(req)
        assert outs["a-1"][-1].usage.cached_tokens > 0
        stats = engine.stats()
        assert stats.load.read_buffer_hits == (1 if layers else 0)
        assert stats.load.read_buffer_layers_used == layers
        assert stats.load.read_buffer_bytes == 0  # consumed
        assert_pool_clean(engine)
        store.close()
    # Unstaged layers each cost the forward a read of the slow tier (DELAY_S each); staged ones
    # none. Counted, not timed: how long they take is bench/preload.py's to measure.
    assert store_reads == {0: 2, 1: 1, 2: 0}


@contextlib.contextmanager
def counted_layer_reads(monkeypatch) -> Iterator[list[int]]:
    """How many layers a load read from the store (not from the read buffer) in the block:
    every such read goes through layer_copy.layer_to_device."""
    reads = [0]
    read = layer_copy.layer_to_device

    def counting(*args, **kwargs):
        reads[0] += 1
        return read(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(layer_copy, "layer_to_device", counting)
        yield reads


def test_queued_sessions_are_staged_while_the_running_job_computes(tmp_path):
    # Staging a session takes ~2 x 5 ms; each job decodes 40 tokens, one step at a time.
    engine, store, _ = _engine(tmp_path, read_buffer_layers=2, max_running=1, delay_s=0.005)
    seconds = {sid: _first_turn(engine, sid, seed) for seed, sid in enumerate("abc", start=1)}
    store.flush_writes()
    reqs = [
        Request(f"{sid}-1", p, greedy(40), tenant="t", session_id=sid) for sid, p in seconds.items()
    ]
    for req in reqs:
        engine.add_request(req)
    outs = run_all(engine)
    for req in reqs:
        assert tokens_of(outs[req.request_id]) == run_alone(req), req.request_id
    stats = engine.stats()
    # a runs first (nothing ahead of it to stage it); b and c are staged while a runs.
    assert stats.load.read_buffer_staged == 2 and stats.load.read_buffer_hits == 2
    assert stats.load.read_buffer_layers_used == 4
    assert stats.load.kv_loads == 3 and stats.load.read_buffer_bytes == 0
    assert_pool_clean(engine)
    store.close()


def test_a_staged_copy_older_than_the_saved_kv_is_not_used(tmp_path):
    engine, store, conn = _engine(tmp_path, read_buffer_layers=2)
    second = _first_turn(engine, "a", 1)
    store.flush_writes()
    assert conn.stage("t", "a")
    _wait_staged(conn, "a", 2)
    # The session's KV changes after staging (here: cut to its first 8 tokens, as a
    # truncation re-save would): the staged copy is stale.
    saved = lookup(store, "t", "a")
    store.save("t", "a", SessionKV(saved.token_ids[:8], saved.kv[:, :, :8].clone()))
    req = Request("a-1", second, greedy(5), tenant="t", session_id="a")
    engine.add_request(req)
    outs = run_all(engine)
    assert tokens_of(outs["a-1"]) == run_alone(req)
    assert outs["a-1"][-1].usage.cached_tokens == 8  # what the store holds now, not the stage
    assert engine.stats().load.read_buffer_hits == 0
    store.close()


def _entry_kv(n: int) -> ChunkedKV:
    return ChunkedKV([(SessionKV(list(range(n)), torch.zeros(1, 2, n, 1, 1)), 0)], 0, n, [])


def test_read_buffer_budget_evicts_idle_entries_only():
    buffer = ReadBuffer(layers=1, capacity_bytes=100)
    a = buffer.want(SessionKey("t", "a"), 0)
    b = buffer.want(SessionKey("t", "b"), 0)
    assert a is not None and b is not None
    assert buffer.want(SessionKey("t", "a"), 0) is None  # fresh already
    assert buffer.begin(a) and buffer.publish(a, _entry_kv(4), 60)
    assert buffer.claim(SessionKey("t", "a"), 0) is a  # in use from here on
    assert buffer.begin(b)
    assert not buffer.publish(b, _entry_kv(4), 60)  # a is in use: no room, nothing evicted
    assert buffer.used_bytes() == 60 and b.cancelled and b.saved is None  # b holds nothing
    buffer.release(a)  # consumed
    b = buffer.want(SessionKey("t", "b"), 0)
    assert len(buffer) == 1 and buffer.begin(b) and buffer.publish(b, _entry_kv(4), 60)
    c = buffer.want(SessionKey("t", "c"), 0)
    assert c is not None and buffer.begin(c) and buffer.publish(c, _entry_kv(4), 70)
    assert buffer.evicted == 1 and b.cancelled and buffer.used_bytes() == 70  # b (idle) out


def test_claim_before_the_lookup_finished_cancels_and_a_new_version_replaces():
    buffer = ReadBuffer(layers=2, capacity_bytes=1 << 20)
    key = SessionKey("t", "a")
    entry = buffer.want(key, 3)
    assert buffer.claim(key, 3) is None and entry.cancelled  # caller looks up itself
    assert not buffer.begin(entry)  # the loader then skips it
    looking = buffer.want(key, 3)
    assert buffer.begin(looking)
    assert buffer.claim(key, 3) is None and looking.cancelled  # not waited for either
    assert not buffer.publish(looking, _entry_kv(4), 10) and len(buffer) == 0
    old = buffer.want(key, 3)
    assert buffer.begin(old)
    new = buffer.want(key, 4)  # the session was saved again: the old stage is dropped
    assert new is not None and old.cancelled
    assert buffer.claim(key, 3) is None
    assert ReadBuffer(0, 1 << 20).want(key, 0) is None  # read buffer off


def test_on_a_cpu_host_only_hints_stage_by_default(tmp_path):
    runtime = tiny_runtime(num_blocks=32)
    settings = StoreSettings(data_dir=tmp_path, dram_bytes=1 << 20, ssd_bytes=0, block_size=4)
    store = AttentionStore(settings, runtime.model.spec, runtime.model.fingerprint)
    conn = StoreConnector(store, runtime.kv_cache, runtime.runner.rope, read_buffer_layers=2)
    assert not conn.stage_queued  # staging beside a running job only moves CPU work around
    engine = LLMEngine(runtime, EngineConfig(), conn)  # gives conn its waiting queue
    engine.add_request(Request("q", [1, 2, 3], greedy(1), tenant="t", session_id="a"))
    conn.look_ahead()  # what the engine calls after each schedule
    assert len(conn.read_buffer) == 0
    assert conn.stage("t", "a") and len(conn.read_buffer) == 1  # a hint does
    store.close()
