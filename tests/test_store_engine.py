"""The store behind the real engine (LLMEngine, tiny model): sessions that interleave over turns
prefill only their new tokens, report them as cached, and answer exactly as a recompute does."""

from __future__ import annotations

import pytest
import torch

from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.llm_engine import LLMEngine
from chatstore.engine.request import Request
from chatstore.store import AttentionStore, StoreConnector, StoreSettings
from tests.engine_support import (  # noqa: F401 (single_thread is an autouse fixture)
    greedy,
    prompt,
    run_all,
    run_alone,
    single_thread,
    tiny_runtime,
    tokens_of,
)


def _engine(tmp_path, prefix_cache: bool, dtype=torch.float32, **store_kw):
    runtime = tiny_runtime(num_blocks=128, dtype=dtype)
    store_kw.setdefault("dram_bytes", 1 << 20)
    settings = StoreSettings(data_dir=tmp_path, ssd_bytes=1 << 22, block_size=4, **store_kw)
    store = AttentionStore(settings, runtime.model.spec, runtime.model.fingerprint)
    conn = StoreConnector(store, runtime.kv_cache, runtime.runner.rope)
    config = EngineConfig(enable_prefix_cache=prefix_cache, max_tokens_per_step=24)
    return LLMEngine(runtime, config, conn), store


@pytest.mark.parametrize(
    "prefix_cache,dram,async_save",
    [
        (False, 1 << 20, False),
        (True, 1 << 20, False),
        (False, 0, False),
        (False, 1 << 20, True),
        (True, 0, True),
    ],
    ids=["dram", "apc", "ssd", "dram-async", "apc-ssd-async"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interleaved_sessions_reuse_history(tmp_path, prefix_cache, dram, async_save, dtype):
    """Restored from each tier (bf16 too, where the store keeps bf16 KV): the same greedy
    tokens as the request alone, computed from scratch."""
    storage = {"storage_dtype": dtype}
    engine, store = _engine(
        tmp_path, prefix_cache, dtype, dram_bytes=dram, async_save=async_save, **storage
    )
    history = {sid: prompt(seed, 9 + 4 * seed) for seed, sid in enumerate(("a", "b", "c"))}
    computed: dict[str, int] = {}  # tokens of the previous turn (prompt + output)
    for turn in range(3):
        reqs = {}
        for sid, ids in history.items():
            req = Request(f"{sid}{turn}", ids, greedy(6), tenant="acme", session_id=sid)
            engine.add_request(req)
            reqs[sid] = req
        outs = run_all(engine)
        for sid, req in reqs.items():
            got = tokens_of(outs[req.request_id])
            assert got == run_alone(req, dtype=dtype), f"session {sid} turn {turn}"
            usage = outs[req.request_id][-1].usage
            if turn == 0:
                assert usage.cached_tokens == 0
            else:
                # All but the last token of the previous turn's output had KV computed.
                assert usage.cached_tokens == computed[sid] - 1
            computed[sid] = len(req.prompt_token_ids) + len(got)
            history[sid] = [*req.prompt_token_ids, *got, *prompt(100 + turn, 5)]
    tier = "dram" if dram else "ssd"
    assert store.stats().counters.tier(tier).hits == 6
    store.close()
