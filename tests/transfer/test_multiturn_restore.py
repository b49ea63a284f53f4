"""End to end with the real default model: history restored from each tier gives the same greedy
tokens as recomputing it, and only the new tokens are prefilled.

No engine here: a few lines drive ModelRunner.forward with ForwardBatch the way the engine does
(num_external_tokens -> load -> prefill with the connector as kv_sink -> decode ->
request_finished), so the store is tested against the runner alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import redis as redis_lib

from chatstore.engine.block_pool import BlockPool
from chatstore.engine.forward_batch import ForwardBatch, SequenceChunk
from chatstore.engine.kv_cache import PagedKVCache
from chatstore.engine.request import Request
from chatstore.engine.runner import ModelRunner
from chatstore.store import AttentionStore, StoreSettings
from chatstore.transfer import StoreConnector
from tests.conftest import chat_ids

pytestmark = [pytest.mark.model, pytest.mark.slow]

BLOCK = 16
MAX_NEW = 8
USER_TURNS = [
    "Name three colours of the rainbow.",
    "Which of them is your favourite, and why?",
    "Now say it again in five words.",
]


@dataclass
class Turn:
    prompt: list[int]
    output: list[int]
    cached: int  # prompt tokens whose KV came from the store


class MiniEngine:
    """One request at a time, the connector calls in the engine's order."""

    def __init__(self, model, connector: StoreConnector | None = None) -> None:
        self.model = model
        self.cache = PagedKVCache(model.spec, 96, BLOCK, model.dtype)
        self.pool = BlockPool(96)
        self.runner = ModelRunner(model.hf_model, model.spec, self.cache)
        self.connector = connector
        self._n = 0

    def attach(self, connector: StoreConnector) -> None:
        self.connector = connector

    def turn(self, prompt: list[int], session: str | None = "s1", on_device: int = 0) -> Turn:
        """on_device: the first tokens are already in the pool (a device prefix-cache hit,
        computed here without the connector): the store supplies only what follows."""
        self._n += 1
        req = Request(f"r{self._n}", list(prompt), tenant="acme", session_id=session)
        conn = self.connector
        blocks = self.pool.allocate(-(-(len(prompt) + MAX_NEW) // BLOCK))
        if on_device:
            self.runner.forward(
                ForwardBatch.build([SequenceChunk(prompt[:on_device], 0, blocks)], BLOCK)
            )
        cached = conn.num_external_tokens(req, on_device) if conn else 0
        if cached:
            conn.load(req, on_device, cached, blocks)
        cached += on_device
        sink = conn.save_layer if conn else None
        chunk = SequenceChunk(prompt[cached:], cached, blocks)
        out: list[int] = []
        for _ in range(MAX_NEW):
            if conn:
                conn.begin_step([req.request_id])
            batch = ForwardBatch.build([chunk], BLOCK)
            token = int(self.runner.forward(batch, kv_sink=sink)[0].argmax())
            out.append(token)
            if token in self.model.spec.eos_token_ids:
                break
            chunk = SequenceChunk([token], chunk.context_len, blocks)
        if conn:
            conn.request_finished(req, prompt + out, blocks)
        self.pool.free(blocks)
        return Turn(list(prompt), out, cached)


def conversation_prompts(tokenizer, replies: list[list[int]]) -> list[list[int]]:
    messages = [{"role": "system", "content": "You are a terse assistant."}]
    prompts = []
    for i, user in enumerate(USER_TURNS):
        messages.append({"role": "user", "content": user})
        prompts.append(chat_ids(tokenizer, messages))
        if i < len(replies):
            text = tokenizer.decode(replies[i], skip_special_tokens=True)
            messages.append({"role": "assistant", "content": text})
    return prompts


@pytest.fixture(scope="module")
def reference(default_model):
    """The conversation with every turn recomputed from scratch (the RE baseline)."""
    engine = MiniEngine(default_model)
    replies: list[list[int]] = []
    turns = []
    for i in range(len(USER_TURNS)):
        prompt = conversation_prompts(default_model.tokenizer, replies)[i]
        turns.append(engine.turn(prompt, session=None))
        replies.append(turns[-1].output)
    return turns


CHUNK = 32  # tokens per stored chunk: several per conversation, so chains and tails are exercised


def make_store(model, data_dir: Path, tier: str, redis_url: str = "") -> AttentionStore:
    dram = {"dram": 64 << 20}.get(tier, 0)
    ssd = {"lmdb": 256 << 20, "restart": 256 << 20}.get(tier, 0)
    settings = StoreSettings(
        data_dir=data_dir,
        dram_bytes=dram,
        ssd_bytes=ssd,
        redis_url=redis_url if tier == "redis" else "",
        redis_bytes=256 << 20,
        chunk_tokens=CHUNK,
    )
    return AttentionStore(settings, model.spec, model.fingerprint)


@pytest.mark.parametrize("tier", ["dram", "lmdb", "redis", "restart"])
def test_history_restored_from_tier_gives_identical_tokens(
    default_model, reference, tier, tmp_path, request
):
    url = request.getfixturevalue("redis_url") if tier == "redis" else ""
    if url:
        redis_lib.Redis.from_url(url).flushall()
    engine = MiniEngine(default_model)
    store = make_store(default_model, tmp_path, tier, url)
    tier_name = {"dram": "dram", "lmdb": "ssd", "restart": "ssd", "redis": "remote"}[tier]
    for i, ref in enumerate(reference):
        if tier == "restart" and i > 0:
            store.close()  # nothing in memory survives: a new store over the same data dir
            store = make_store(default_model, tmp_path, tier)
            chain = store.index.get(store.key("acme", "s1"))
            assert set(store.tier("ssd").keys()) == set(chain.chunks)
        engine.attach(StoreConnector(store, engine.cache, engine.runner.rope))
        got = engine.turn(ref.prompt)
        assert got.output == ref.output, f"turn {i + 1} differs when restored from {tier}"
        if i == 0:
            assert got.cached == 0
        else:
            prev = reference[i - 1]
            # Everything up to the previous reply's re-rendering is reused.
            assert got.cached >= len(prev.prompt) + len(prev.output) - 2
            assert store.stats().counters.tier(tier_name).hits > 0
        assert store.tier_of("acme", "s1") == tier_name
    saved = store.saved_tokens("acme", "s1")
    assert saved == (reference[-1].prompt + reference[-1].output)[: len(saved)]
    store.close()


def test_history_split_between_device_and_store_gives_identical_tokens(
    default_model, reference, tmp_path
):
    """The device holds the first tokens (8, then 40: not chunk boundaries): the store loads
    only the chunks past them (the third turn skips chunk 0), and the answer is the
    recompute's."""
    engine = MiniEngine(default_model)
    store = make_store(default_model, tmp_path, "dram")
    engine.attach(StoreConnector(store, engine.cache, engine.runner.rope))
    for i, ref in enumerate(reference):
        device = [0, 8, 40][i]
        hits = store.stats().counters.tier("dram").hits
        got = engine.turn(ref.prompt, on_device=device)
        assert got.output == ref.output, f"turn {i + 1} differs"
        if i:
            read = store.stats().counters.tier("dram").hits - hits
            assert got.cached > device
            assert read == -(-got.cached // CHUNK) - device // CHUNK  # chunks past the device
    store.close()


def test_corrupted_lmdb_value_is_a_miss_and_recomputed(default_model, reference, tmp_path):
    engine = MiniEngine(default_model)
    store = make_store(default_model, tmp_path, "lmdb")
    engine.attach(StoreConnector(store, engine.cache, engine.runner.rope))
    engine.turn(reference[0].prompt)
    ssd = store.tier("ssd")
    first = store.index.get(store.key("acme", "s1")).chunks[0]
    chunk = bytearray(ssd.raw_value(first))
    chunk[len(chunk) // 2] ^= 0x01  # one flipped bit in the middle of the KV
    ssd.write_raw_value(first, bytes(chunk))
    got = engine.turn(reference[1].prompt)
    assert got.cached == 0 and got.output == reference[1].output
    assert store.stats().counters.tier("ssd").corrupt == 1
    store.close()


def test_another_models_store_is_not_reused(default_model, reference, tmp_path):
    engine = MiniEngine(default_model)
    store = make_store(default_model, tmp_path, "lmdb")
    engine.attach(StoreConnector(store, engine.cache, engine.runner.rope))
    engine.turn(reference[0].prompt)
    store.close()
    other = AttentionStore(
        StoreSettings(data_dir=tmp_path, dram_bytes=0, ssd_bytes=256 << 20),
        default_model.spec,
        "another-model-fingerprint",
    )
    engine.attach(StoreConnector(other, engine.cache, engine.runner.rope))
    got = engine.turn(reference[1].prompt)
    assert got.cached == 0 and got.output == reference[1].output
    other.close()
