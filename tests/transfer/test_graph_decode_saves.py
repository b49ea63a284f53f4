"""Decode steps through the decode-graph path (cuda_graphs.py, here on a CPU without capture)
hand their pre-RoPE K, V to the store's saver after the forward, not from inside it: a session
whose first turn decoded that way must come back from the DRAM tier exactly, as a recompute."""

from __future__ import annotations

import pytest

from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.llm_engine import LLMEngine
from chatstore.engine.request import Request
from chatstore.store.attention_store import AttentionStore
from chatstore.store.settings import StoreSettings
from chatstore.transfer import StoreConnector
from tests.support.engine import greedy, prompt, run_all, run_alone, tiny_runtime, tokens_of

pytestmark = pytest.mark.usefixtures("single_thread")


def test_turns_decoded_through_the_graph_path_restore_exactly(tmp_path) -> None:
    runtime = tiny_runtime(num_blocks=128)
    settings = StoreSettings(
        data_dir=tmp_path, dram_bytes=1 << 20, ssd_bytes=1 << 22, block_size=4, chunk_tokens=8
    )
    store = AttentionStore(settings, runtime.model.spec, runtime.model.fingerprint)
    conn = StoreConnector(store, runtime.kv_cache, runtime.runner.rope)
    config = EngineConfig(enable_prefix_cache=False, max_tokens_per_step=24, cuda_graphs=True)
    engine = LLMEngine(runtime, config, conn)
    graphs = engine._forward.graphs
    assert graphs is not None and graphs.saves_kv
    history = {sid: prompt(seed, 9 + 4 * seed) for seed, sid in enumerate(("a", "b", "c"))}
    computed: dict[str, int] = {}
    for turn in range(2):
        reqs = {}
        for sid, ids in history.items():
            reqs[sid] = Request(f"{sid}{turn}", ids, greedy(7), tenant="acme", session_id=sid)
            engine.add_request(reqs[sid])
        replays = graphs.replays
        outs = run_all(engine)
        assert graphs.replays > replays  # decodes went through the graph path
        for sid, req in reqs.items():
            got = tokens_of(outs[req.request_id])
            assert got == run_alone(req), f"session {sid} turn {turn}"
            cached = outs[req.request_id][-1].usage.cached_tokens
            # The previous turn's decoded tokens (all but the last) came back from the store.
            assert cached == (computed[sid] - 1 if turn else 0)
            computed[sid] = len(req.prompt_token_ids) + len(got)
            history[sid] = [*req.prompt_token_ids, *got, *prompt(100 + turn, 5)]
    assert store.stats().counters.tier("dram").hits > 0
    store.close()
