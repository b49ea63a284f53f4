"""The GPU's host paths, switched on in a CPU engine: the DRAM tier read in place (leased pool
blocks), the loader's staging ring, and the saver's device path (host_copies.py) through its
ring. Sessions must come back from DRAM with a recompute's tokens, and every lease and slot
must be given back. (The engine thread's loads read host memory only, so values from LMDB
reach the loader through the ring in test_loader_host_reads.py, with a real LMDB tier.)"""

from __future__ import annotations

import gc

import pytest
import torch

from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.llm_engine import LLMEngine
from chatstore.engine.request import Request
from chatstore.store.attention_store import AttentionStore
from chatstore.store.settings import StoreSettings
from chatstore.store.tiers.dram import DramTier
from chatstore.transfer import StoreConnector
from chatstore.transfer.host_copies import HostCopies
from chatstore.transfer.pinned_staging import StagingRing
from tests.support.engine import greedy, prompt, run_all, run_alone, tiny_runtime, tokens_of

pytestmark = pytest.mark.usefixtures("single_thread")


def test_sessions_restore_exactly_through_the_host_paths(tmp_path) -> None:
    runtime = tiny_runtime(num_blocks=128)
    settings = StoreSettings(
        data_dir=tmp_path, dram_bytes=1 << 20, ssd_bytes=1 << 22, block_size=4, chunk_tokens=8
    )
    store = AttentionStore(settings, runtime.model.spec, runtime.model.fingerprint)
    dram = store.tier("dram")
    assert isinstance(dram, DramTier)
    dram.read_in_place = True
    conn = StoreConnector(store, runtime.kv_cache, runtime.runner.rope)
    load_ring = StagingRing(1 << 16, pin=False)
    conn.loader.copier.staging = load_ring
    save_copies = HostCopies(torch.device("cpu"), conn.saver.row_dtype, conn.saver.num_layers)
    conn.saver._host_copies = save_copies
    engine = LLMEngine(runtime, EngineConfig(enable_prefix_cache=False), conn)
    history = {sid: prompt(seed, 9 + 4 * seed) for seed, sid in enumerate(("a", "b"))}
    for turn in range(3):
        reqs = {}
        for sid, ids in history.items():
            reqs[sid] = Request(f"{sid}{turn}", ids, greedy(6), tenant="acme", session_id=sid)
            engine.add_request(reqs[sid])
        outs = run_all(engine)
        for sid, req in reqs.items():
            got = tokens_of(outs[req.request_id])
            assert got == run_alone(req), f"session {sid} turn {turn}"
            if turn:
                assert outs[req.request_id][-1].usage.cached_tokens > 0
            history[sid] = [*req.prompt_token_ids, *got, *prompt(100 + turn, 5)]
    assert save_copies.step_copies > 0 and save_copies.ring.in_use() == 0
    copier = conn.loader.copier
    assert copier.pooled_runs > 0 and copier.plain_rows == 0  # DRAM read in place
    assert load_ring.in_use() == 0
    del outs, reqs
    conn.close()
    gc.collect()
    dram.check_integrity()
    store.close()
