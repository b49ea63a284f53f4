"""KV that only Redis holds is reused by the turn that asked for it, however small the DRAM
tier above Redis is (issue 21, the Redis-outage reuse failure).

The engine's thread reads no remote tier: the API thread that opens a turn
(`AttentionStore.open_turn`) brings the session's Redis-only chunks up first. With a DRAM
tier smaller than the session, or shared with another turn opened at the same time, each
promotion used to evict the chunks promoted just before it (the session being opened ranked
lowest, and its latest chunks go first), so the admission read found them back in Redis only
and recomputed them: KV moved up for nothing. The turn now holds its chunks from its opening
until the engine has read them: pinned in DRAM, or kept beside it when DRAM cannot take them.

A tiny random model (tests/support/tiny_models.py) and the real Redis fixture; every reuse is
checked against a full recompute.
"""

from __future__ import annotations

import gc

import pytest
import redis as redis_lib
import torch

from chatstore.engine.block_pool import BlockPool
from chatstore.engine.forward_batch import ForwardBatch, SequenceChunk
from chatstore.engine.kv_cache import PagedKVCache
from chatstore.engine.request import Request
from chatstore.engine.runner import ModelRunner
from chatstore.model.spec import ModelSpec
from chatstore.store.attention_store import AttentionStore
from chatstore.store.session_kv import SessionKey
from chatstore.store.settings import StoreSettings
from chatstore.transfer import StoreConnector
from tests.support.store import held_bytes
from tests.support.tiny_models import tiny_hf_model

BLOCK = 4  # tokens per device and DRAM block
CHUNK = 8  # tokens per stored chunk
TENANT = "t"


class Rig:
    """A tiny model, its device pool, and a store of DRAM (room for `dram_chunks` chunks)
    above Redis, with no SSD tier: what leaves DRAM lives in Redis only."""

    def __init__(self, tmp_path, redis_url: str, dram_chunks: int) -> None:
        model = tiny_hf_model("qwen2", seed=3)
        self.spec = ModelSpec.from_hf_config(model.config)
        self.cache = PagedKVCache(self.spec, 400, BLOCK)
        self.pool = BlockPool(400)
        self.runner = ModelRunner(model, self.spec, self.cache)
        token_bytes = 2 * self.spec.num_layers * self.spec.num_kv_heads * self.spec.head_dim * 4
        settings = StoreSettings(
            data_dir=tmp_path,
            dram_bytes=dram_chunks * CHUNK * token_bytes,
            ssd_bytes=0,
            redis_url=redis_url,
            redis_bytes=64 << 20,
            block_size=BLOCK,
            chunk_tokens=CHUNK,
            persist="off",
        )
        self.store = AttentionStore(settings, self.spec, "tiny")
        self.conn = StoreConnector(self.store, self.cache, self.runner.rope)
        self._n = 0

    def close(self) -> None:
        self.store.close(flush_dram=False)

    def forward(self, chunk: SequenceChunk, rid: str | None) -> torch.Tensor:
        batch = ForwardBatch.build([chunk], BLOCK, all_logits=True)
        if rid is not None:
            batch.request_ids = [rid]
        sink = self.conn.save_layer if rid is not None else None
        return self.runner.forward(batch, kv_sink=sink)[-1]

    def recompute(self, prompt: list[int]) -> torch.Tensor:
        blocks = self.pool.allocate(-(-len(prompt) // BLOCK))
        out = self.forward(SequenceChunk(prompt, 0, blocks), None)
        self.pool.free(blocks)
        return out

    def admit(self, sid: str, prompt: list[int], opened=None) -> tuple[Request, int]:
        """The engine's admission of a turn (`opened`: the API's handle of it, on the
        request): how many prompt tokens the store supplies (read here, on the engine's side
        of the store: no remote tier)."""
        self._n += 1
        req = Request(f"r{self._n}", list(prompt), tenant=TENANT, session_id=sid)
        req.store_turn = opened
        return req, self.conn.num_external_tokens(req, 0)

    def run(self, req: Request, cached: int) -> torch.Tensor:
        """Load the reused history, prefill the rest, save the turn; the last logits."""
        prompt = req.prompt_token_ids
        blocks = self.pool.allocate(-(-(len(prompt) + 1) // BLOCK))
        if cached:
            self.conn.load(req, 0, cached, blocks)
        logits = self.forward(SequenceChunk(prompt[cached:], cached, blocks), req.request_id)
        self.conn.request_finished(req, list(prompt), blocks)
        self.pool.free(blocks)
        return logits

    def turn(self, sid: str, prompt: list[int]) -> int:
        req, cached = self.admit(sid, prompt)
        self.run(req, cached)
        return cached

    def only_in_redis(self, sid: str) -> list:
        """The session's chunks left in Redis alone, as evictions would leave them."""
        store = self.store
        chain = store.index.get(SessionKey(TENANT, sid))
        assert chain is not None
        for chunk in chain.chunks:
            assert store.tiers.share(chunk), f"chunk {chunk} did not reach Redis"
            with store.tiers.lock:
                store.tier("dram").delete(chunk)
            assert store.tiers.where(chunk) == "remote"
        return list(chain.chunks)


@pytest.fixture
def redis(redis_url):
    redis_lib.Redis.from_url(redis_url).flushall()
    return redis_url


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 256, (n,), generator=g).tolist()


def assert_reused(rig: Rig, req: Request, cached: int, history: list[int]) -> None:
    assert cached == len(history), f"{cached} of {len(history)} history tokens reused"
    got = rig.run(req, cached)
    want = rig.recompute(req.prompt_token_ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_session_larger_than_dram_is_reused_whole_from_redis(tmp_path, redis):
    """Five chunks in Redis, DRAM room for two: the turn-opening fetch must not evict what
    it brought up before the engine reads it."""
    rig = Rig(tmp_path, redis, dram_chunks=2)
    try:
        history = tokens(5 * CHUNK, seed=1)
        assert rig.turn("a", history) == 0
        chunks = rig.only_in_redis("a")
        assert len(chunks) == 5
        before = rig.store.stats().counters.bytes_up

        opened = rig.store.open_turn(TENANT, "a")  # the API's worker thread opens the turn
        req, cached = rig.admit("a", [*history, 7, 8, 9], opened)
        assert_reused(rig, req, cached, history)
        assert rig.store.stats().counters.bytes_up - before >= 5 * CHUNK * 2 * 2 * 2 * 16 * 4
        # Once the engine has read it, the turn holds nothing: DRAM is the policy's again.
        assert not rig.store.pins and held_bytes(rig.store) == 0
        rig.store.tiers.check_capacity()
    finally:
        rig.close()


def test_turns_opened_together_do_not_evict_each_others_chunks(tmp_path, redis):
    """Two sessions of two chunks each, DRAM room for two: both turns open (their chunks come
    up from Redis), then both are admitted. The second opening used to push the first's
    chunks back out before its admission."""
    rig = Rig(tmp_path, redis, dram_chunks=2)
    try:
        histories = {"a": tokens(2 * CHUNK, seed=2), "b": tokens(2 * CHUNK, seed=3)}
        for sid, history in histories.items():
            assert rig.turn(sid, history) == 0
        for sid in histories:
            rig.only_in_redis(sid)

        opened = {sid: rig.store.open_turn(TENANT, sid) for sid in histories}
        for sid, history in histories.items():
            req, cached = rig.admit(sid, [*history, 5, 6], opened[sid])
            assert_reused(rig, req, cached, history)
        assert not rig.store.pins and held_bytes(rig.store) == 0
    finally:
        rig.close()


def test_an_opened_turn_that_never_runs_lets_go_of_its_chunks(tmp_path, redis):
    """A turn opened and never admitted (refused by the engine, client gone) lets go of its
    chunks when the API ends it (`end_turn`), or, dropped without an end, when its handle is
    collected; two turns opened on one session pin its chunks until both let go."""
    rig = Rig(tmp_path, redis, dram_chunks=2)
    try:
        history = tokens(4 * CHUNK, seed=4)
        rig.turn("a", history)
        rig.only_in_redis("a")
        first = rig.store.open_turn(TENANT, "a")
        second = rig.store.open_turn(TENANT, "a")
        assert len(rig.store.pins) == 4 and held_bytes(rig.store) > 0

        rig.store.end_turn(first)  # the API ends a turn the engine refused
        assert len(rig.store.pins) == 4, "the second turn's pins went with the first's"
        del second  # a caller that never ends its turn
        gc.collect()
        assert not rig.store.pins and held_bytes(rig.store) == 0
        # Nothing was lost: the chunks are still in Redis, and DRAM is no longer reserved.
        assert rig.store.find(TENANT, "a").num_tokens == len(history)
        rig.store.tiers.check_capacity()
    finally:
        rig.close()
