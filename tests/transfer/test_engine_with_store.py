"""The store behind the real engine (LLMEngine, tiny model): sessions that interleave over turns
prefill only their new tokens, report them as cached, and answer exactly as a recompute does."""

from __future__ import annotations

import pytest
import torch

from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.llm_engine import LLMEngine
from chatstore.engine.request import Request
from chatstore.store.attention_store import AttentionStore
from chatstore.store.settings import StoreSettings
from chatstore.transfer import StoreConnector
from tests.support.engine import (
    greedy,
    prompt,
    run_all,
    run_alone,
    tiny_runtime,
    tokens_of,
)

pytestmark = pytest.mark.usefixtures("single_thread")


def _engine(tmp_path, prefix_cache: bool, dtype=torch.float32, layout="paged", **store_kw):
    runtime = tiny_runtime(num_blocks=128, dtype=dtype, layout=layout)
    store_kw.setdefault("dram_bytes", 1 << 20)
    store_kw.setdefault("chunk_tokens", 8)  # several chunks per session: chains, tails, sharing
    settings = StoreSettings(data_dir=tmp_path, ssd_bytes=1 << 22, block_size=4, **store_kw)
    store = AttentionStore(settings, runtime.model.spec, runtime.model.fingerprint)
    conn = StoreConnector(store, runtime.kv_cache, runtime.runner.rope)
    config = EngineConfig(enable_prefix_cache=prefix_cache, max_tokens_per_step=24)
    return LLMEngine(runtime, config, conn), store


@pytest.mark.parametrize(
    "prefix_cache,dram,async_save,layout",
    [
        (False, 1 << 20, False, "paged"),
        (True, 1 << 20, False, "paged"),
        (False, 0, False, "paged"),
        (False, 1 << 20, True, "paged"),
        (True, 0, True, "paged"),
        (False, 1 << 20, True, "vattention"),
        (False, 0, False, "vattention"),
    ],
    ids=["dram", "apc", "ssd", "dram-async", "apc-ssd-async", "dram-async-va", "ssd-va"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interleaved_sessions_reuse_history(
    tmp_path, prefix_cache, dram, async_save, layout, dtype
):
    """Restored from each tier (bf16 too, where the store keeps bf16 KV), into paged blocks or
    vAttention slots: the same greedy tokens as the request alone, computed from scratch."""
    storage = {"storage_dtype": dtype}
    engine, store = _engine(
        tmp_path, prefix_cache, dtype, layout, dram_bytes=dram, async_save=async_save, **storage
    )
    history = {sid: prompt(seed, 9 + 4 * seed) for seed, sid in enumerate(("a", "b", "c"))}
    computed: dict[str, int] = {}  # tokens of the previous turn (prompt + output)
    for turn in range(3):
        reqs = {}
        for sid, ids in history.items():
            req = Request(f"{sid}{turn}", ids, greedy(6), tenant="acme", session_id=sid)
            req.store_turn = store.open_turn("acme", sid)  # the API opens the turn: LMDB -> host
            engine.add_request(req)
            reqs[sid] = req
        outs = run_all(engine)
        # The API opens a session's next turn once this one's save is committed: so here (with
        # async save the last rows may still be on their way; one token less came back once).
        assert store.flush_writes(30)
        for sid, req in reqs.items():
            got = tokens_of(outs[req.request_id])
            alone = run_alone(req, dtype=dtype, layout=layout)
            assert got == alone, f"session {sid} turn {turn}"
            usage = outs[req.request_id][-1].usage
            if turn == 0:
                assert usage.cached_tokens == 0
            else:
                # All but the last token of the previous turn's output had KV computed.
                assert usage.cached_tokens == computed[sid] - 1
            computed[sid] = len(req.prompt_token_ids) + len(got)
            history[sid] = [*req.prompt_token_ids, *got, *prompt(100 + turn, 5)]
    tier = "dram" if dram else "ssd"
    if not prefix_cache:  # with it, the device holds every history: nothing to load
        assert store.stats().counters.tier(tier).hits > 0
    store.close()


def test_sessions_sharing_a_system_prompt_store_it_once(tmp_path):
    """Two sessions that start with the same 24 tokens answer as recomputes do, and the
    prompt's three full chunks exist once, held by both."""
    engine, store = _engine(tmp_path, prefix_cache=False)
    system = prompt(7, 24)
    histories = {"a": system + prompt(1, 5), "b": system + prompt(2, 7)}
    for turn in range(2):
        reqs = {
            sid: Request(f"{sid}{turn}", ids, greedy(5), tenant="acme", session_id=sid)
            for sid, ids in histories.items()
        }
        for req in reqs.values():
            engine.add_request(req)
        outs = run_all(engine)
        for sid, req in reqs.items():
            got = tokens_of(outs[req.request_id])
            assert got == run_alone(req), f"session {sid} turn {turn}"
            histories[sid] = [*req.prompt_token_ids, *got, *prompt(10 + turn, 4)]
    store.flush_writes(10)
    a = store.index.get(store.key("acme", "a")).chunks
    b = store.index.get(store.key("acme", "b")).chunks
    assert a[:3] == b[:3] and a[3] != b[3]
    both = {store.key("acme", "a"), store.key("acme", "b")}
    assert all(store.index.owners_of(k) == both for k in a[:3])
    assert store.tiers.keys() == set(a) | set(b)  # each chunk once, nothing else
    store.close()


def test_bytes_written_per_turn_follow_the_new_tokens(tmp_path):
    """40 turns: each writes its new tokens' KV (and rewrites at most the tail chunk), never
    the history (the Store v2 bar: <= 1.25 x new tokens' bytes + one chunk)."""
    engine, store = _engine(tmp_path, prefix_cache=True, async_save=True)
    per_token = store.layout.bytes_per_token
    chunk = store.settings.chunk_tokens * per_token
    history = prompt(3, 12)
    saved = kept = 0  # bytes written so far; tokens whose KV the store held after a turn
    for turn in range(40):
        req = Request(f"t{turn}", history, greedy(4), tenant="acme", session_id="s")
        engine.add_request(req)
        got = tokens_of(run_all(engine)[req.request_id])
        store.flush_writes(10)
        now = len(history) + len(got) - 1  # the last token has no KV
        written = store.bytes_written - saved
        assert written <= 1.25 * (now - kept) * per_token + chunk, f"turn {turn}"
        saved, kept = store.bytes_written, now
        history = [*history, *got, *prompt(50 + turn, 6)]
    assert len(history) > 400  # the history grew far beyond what a turn writes
    store.close()
