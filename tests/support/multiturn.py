"""A conversation with the real default model driven through ModelRunner the way the server does
(the API opens the turn: open_turn, its handle on the request; then the engine:
num_external_tokens -> load -> prefill with the connector as kv_sink -> decode ->
request_finished), one request at a time, and the
store it restores from: shared by the multi-turn restore tests (tests/transfer) and encryption
at rest (tests/store/sealing)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from chatstore.engine.block_pool import BlockPool
from chatstore.engine.forward_batch import ForwardBatch, SequenceChunk
from chatstore.engine.kv_cache import PagedKVCache
from chatstore.engine.request import Request
from chatstore.engine.runner import ModelRunner
from chatstore.store.attention_store import AttentionStore
from chatstore.store.settings import StoreSettings
from chatstore.transfer import StoreConnector
from tests.support.tiny_models import chat_ids

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
        self.runner = ModelRunner(model.weights, model.spec, self.cache)
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
        if conn and session is not None:  # the API opens the turn first (SSD, Redis -> host)
            req.store_turn = conn.store.open_turn("acme", session)  # type: ignore[attr-defined]
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


def recompute_conversation(default_model) -> list[Turn]:
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
