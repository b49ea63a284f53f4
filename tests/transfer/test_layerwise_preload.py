"""Layer-wise pre-load (CachedAttention §3.2.1): the history KV is copied layer by layer on the
loader thread while the forward runs; each layer's attention waits for its layer's copy only.
With a slow tier simulated (a per-layer delay), outputs stay token-identical to the synchronous
load and to recomputing the history, and no layer is read before its copy finished."""

from __future__ import annotations

import pytest

from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.llm_engine import LLMEngine
from chatstore.engine.request import Request
from chatstore.store.attention_store import AttentionStore
from chatstore.store.settings import StoreSettings
from chatstore.transfer import StoreConnector
from tests.support.engine import (
    assert_pool_clean,
    greedy,
    prompt,
    run_all,
    run_alone,
    tiny_runtime,
    tokens_of,
)

pytestmark = pytest.mark.usefixtures("single_thread")

DELAY_S = 0.02


class SyncConnector(StoreConnector):
    """The synchronous path: not layer-wise, so the engine calls load() before the forward."""

    layerwise = False


def _engine(tmp_path, cls=StoreConnector, layout="paged", **conn_kw):
    runtime = tiny_runtime(num_blocks=128, layout=layout)
    settings = StoreSettings(data_dir=tmp_path, dram_bytes=1 << 20, ssd_bytes=1 << 22, block_size=4)
    store = AttentionStore(settings, runtime.model.spec, runtime.model.fingerprint)
    conn = cls(store, runtime.kv_cache, runtime.runner.rope, **conn_kw)
    config = EngineConfig(enable_prefix_cache=False, max_tokens_per_step=24)
    return LLMEngine(runtime, config, conn), store, conn


def _turns(engine, n_turns: int = 3, layout: str = "paged") -> dict[str, list[list[int]]]:
    """Two interleaved sessions over n_turns; {session: [tokens of each turn]}."""
    history = {sid: prompt(seed, 9 + 5 * seed) for seed, sid in enumerate(("a", "b"))}
    got: dict[str, list[list[int]]] = {sid: [] for sid in history}
    for turn in range(n_turns):
        reqs = {}
        for sid, ids in history.items():
            req = Request(f"{sid}{turn}", ids, greedy(5), tenant="t", session_id=sid)
            engine.add_request(req)
            reqs[sid] = req
        outs = run_all(engine)
        for sid, req in reqs.items():
            toks = tokens_of(outs[req.request_id])
            got[sid].append(toks)
            alone = run_alone(req, layout=layout)
            assert toks == alone, f"session {sid} turn {turn} differs from recompute"
            if turn > 0:
                assert outs[req.request_id][-1].usage.cached_tokens > 0
            history[sid] = [*req.prompt_token_ids, *toks, *prompt(50 + turn, 4)]
    return got


@pytest.mark.parametrize("inline", [False, True], ids=["loader-thread", "inline"])
@pytest.mark.parametrize("layout", ["paged", "vattention"])
def test_preload_is_token_identical_to_sync_load_and_recompute(tmp_path, layout, inline):
    """inline: the forward issues each layer's copy one layer ahead (CUDA's default), here
    forced on a CPU: no loader thread is started for the loads."""
    engine, store, conn = _engine(
        tmp_path / "pre", layout=layout, layer_delay_s=DELAY_S, inline_loads=inline
    )
    pre = _turns(engine, layout=layout)
    assert conn.loads_started == 4  # 2 sessions x turns 1, 2
    assert (conn.loader._thread is None) == inline
    assert conn.load_wait_s > 0  # the forward did wait for the slow copies
    # Each slow copy ran on the loader or, when the forward got there first, on the forward.
    assert conn.load_copy_s + conn.load_wait_s >= 4 * engine.spec.num_layers * DELAY_S * 0.9
    assert_pool_clean(engine)
    store.close()
    engine_s, store_s, conn_s = _engine(tmp_path / "sync", cls=SyncConnector, layout=layout)
    assert _turns(engine_s, layout=layout) == pre
    assert conn_s.loads_started == 0 and conn_s.load_wait_s == 0
    store_s.close()


@pytest.mark.parametrize("inline", [False, True], ids=["loader-thread", "inline"])
def test_no_layer_is_read_before_its_copy_finished(tmp_path, inline):
    engine, store, conn = _engine(tmp_path, layer_delay_s=DELAY_S, inline_loads=inline)
    copied: set[tuple[str, int]] = set()
    copy_layer = conn.loader.copy_layer

    def recording_copy(job, layer):
        copy_layer(job, layer)  # includes the delay: the layer counts as done after it
        copied.add((job.request_id, layer))

    conn.loader.copy_layer = recording_copy  # type: ignore[method-assign]
    wait = conn.wait_for_layer
    checks: list[tuple[int, bool, int]] = []  # (layer, complete, layers complete at the call)

    def layer_ready(layer: int) -> None:
        wait(layer)
        ids = [job.request_id for job in conn._jobs]
        done_now = sum(
            all((rid, j) in copied for rid in ids) for j in range(engine.spec.num_layers)
        )
        checks.append((layer, all((rid, layer) in copied for rid in ids), done_now))

    conn.wait_for_layer = layer_ready  # type: ignore[method-assign]
    _turns(engine, n_turns=2)
    assert checks, "layer_ready never called"
    assert all(ok for _, ok, _ in checks)
    assert [layer for layer, _, _ in checks[: engine.spec.num_layers]] == list(
        range(engine.spec.num_layers)
    )
    store.close()


def test_failed_preload_ends_only_that_request_with_an_error(tmp_path):
    engine, store, conn = _engine(tmp_path)
    history = prompt(1, 14)
    engine.add_request(Request("a0", history, greedy(4), tenant="t", session_id="a"))
    out = tokens_of(run_all(engine)["a0"])
    copy_layer = conn.loader.copy_layer

    def broken(job, layer):
        if job.request_id == "a1" and layer == 1:
            raise OSError("tier on fire")
        copy_layer(job, layer)

    conn.loader.copy_layer = broken  # type: ignore[method-assign]
    engine.add_request(Request("a1", [*history, *out, 5, 6], greedy(4), tenant="t", session_id="a"))
    engine.add_request(Request("b", prompt(2, 7), greedy(4)))
    outs = run_all(engine)
    final = outs["a1"][-1]
    assert final.samples[-1].finish_reason == "error"
    assert "tier on fire" in (final.error or "")
    assert len(tokens_of(outs["b"])) == 4
    assert conn.finish_loads() == {}
    assert_pool_clean(engine)
    store.close()


@pytest.mark.model
def test_default_model_preload_matches_recompute(default_model, tmp_path):
    """SmolLM2-135M (30 layers), two turns: pre-loaded history answers as a recompute does."""
    from chatstore.config import Config
    from chatstore.engine.runtime import create_runtime

    def engine(with_store: bool):
        runtime = create_runtime(Config(kv_cache_bytes=32 << 20), model=default_model)
        conn = None
        if with_store:
            spec = runtime.model.spec
            settings = StoreSettings(data_dir=tmp_path, dram_bytes=64 << 20, ssd_bytes=1 << 26)
            store = AttentionStore(settings, spec, runtime.model.fingerprint)
            conn = StoreConnector(store, runtime.kv_cache, runtime.runner.rope, layer_delay_s=0.002)
        return LLMEngine(runtime, EngineConfig(enable_prefix_cache=False), conn), conn

    pre, conn = engine(True)
    history = prompt(7, 40, vocab=default_model.spec.vocab_size)
    for turn in range(2):
        req = Request(f"t{turn}", history, greedy(6), tenant="t", session_id="s")
        pre.add_request(req)
        got = tokens_of(run_all(pre)[req.request_id])
        plain, _ = engine(False)
        plain.add_request(Request(f"t{turn}", history, greedy(6)))
        assert got == tokens_of(run_all(plain)[f"t{turn}"]), f"turn {turn}"
        history = [*history, *got, *prompt(20 + turn, 5, vocab=default_model.spec.vocab_size)]
    assert conn.loads_started == 1 and conn.load_wait_s > 0
    conn.store.close()
