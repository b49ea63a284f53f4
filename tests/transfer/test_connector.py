"""StoreConnector with a tiny random model: sessions batched together, chunked prefill, and the
device fallback all restore KV that reproduces a full recompute."""

from __future__ import annotations

import torch

from chatstore.engine.block_pool import BlockPool
from chatstore.engine.forward_batch import ForwardBatch, SequenceChunk
from chatstore.engine.kv_cache import PagedKVCache
from chatstore.engine.request import Request
from chatstore.engine.runner import ModelRunner
from chatstore.model.spec import ModelSpec
from chatstore.store.attention_store import AttentionStore
from chatstore.store.settings import StoreSettings
from chatstore.transfer import StoreConnector
from tests.support.store import lookup, saved_tokens
from tests.support.tiny_models import tiny_hf_model

BLOCK = 4


class Rig:
    def __init__(self, tmp_path) -> None:
        model = tiny_hf_model("qwen2", seed=1)
        self.spec = ModelSpec.from_hf_config(model.config)
        self.cache = PagedKVCache(self.spec, 200, BLOCK)
        self.pool = BlockPool(200)
        self.runner = ModelRunner(model, self.spec, self.cache)
        settings = StoreSettings(data_dir=tmp_path, dram_bytes=1 << 20, ssd_bytes=1 << 20)
        self.store = AttentionStore(settings, self.spec, "tiny")
        self.conn = StoreConnector(self.store, self.cache, self.runner.rope)

    def blocks(self, n: int) -> list[int]:
        return self.pool.allocate(-(-n // BLOCK))

    def logits(self, chunks: list[SequenceChunk], ids: list[str] | None = None) -> torch.Tensor:
        batch = ForwardBatch.build(chunks, BLOCK, all_logits=True)
        if ids is not None:
            batch.request_ids = ids  # what the engine is asked to attach
        sink = self.conn.save_layer if ids is not None else None
        return self.runner.forward(batch, kv_sink=sink)

    def recompute(self, prompt: list[int]) -> torch.Tensor:
        blocks = self.blocks(len(prompt))
        out = self.logits([SequenceChunk(prompt, 0, blocks)])[-1]
        self.pool.free(blocks)
        return out


def test_two_sessions_batched_then_restored(tmp_path):
    rig = Rig(tmp_path)
    g = torch.Generator().manual_seed(0)
    p1 = torch.randint(2, 256, (13,), generator=g).tolist()
    p2 = torch.randint(2, 256, (7,), generator=g).tolist()
    r1 = Request("a", p1, tenant="t", session_id="one")
    r2 = Request("b", p2, tenant="t", session_id="two")
    assert rig.conn.num_external_tokens(r1, 0) == 0 == rig.conn.num_external_tokens(r2, 0)
    b1, b2 = rig.blocks(20), rig.blocks(20)
    # Chunked prefill of r1 (8 + 5 tokens) next to r2's whole prompt, then one decode step each.
    rig.logits([SequenceChunk(p1[:8], 0, b1), SequenceChunk(p2, 0, b2)], ["a", "b"])
    rig.logits([SequenceChunk(p1[8:], 8, b1)], ["a"])
    rig.logits([SequenceChunk([5], 13, b1), SequenceChunk([6], 7, b2)], ["a", "b"])
    rig.conn.request_finished(r1, [*p1, 5, 9], b1)  # 9 was sampled last: it has no KV
    rig.conn.request_finished(r2, [*p2, 6], b2)
    rig.pool.free(b1 + b2)
    assert saved_tokens(rig.store, "t", "one") == [*p1, 5]
    assert saved_tokens(rig.store, "t", "two") == [*p2, 6]

    for sid, history in (("one", [*p1, 5]), ("two", [*p2, 6])):
        prompt = [*history, 11, 12, 13]
        req = Request(f"next-{sid}", prompt, tenant="t", session_id=sid)
        n = rig.conn.num_external_tokens(req, 0)
        assert n == len(history)
        blocks = rig.blocks(len(prompt))
        rig.conn.load(req, 0, n, blocks)
        got = rig.logits([SequenceChunk(prompt[n:], n, blocks)], [req.request_id])[-1]
        torch.testing.assert_close(got, rig.recompute(prompt), rtol=1e-4, atol=1e-4)
        assert int(got.argmax()) == int(rig.recompute(prompt).argmax())
        rig.conn.request_finished(req, prompt, blocks)
        rig.pool.free(blocks)


def test_partial_device_prefix_and_device_fallback(tmp_path):
    rig = Rig(tmp_path)
    prompt = list(range(30, 50))
    req = Request("x", prompt, tenant="t", session_id="s")
    blocks = rig.blocks(len(prompt))
    # The engine never asked the connector about this request: its KV is read back from the
    # device blocks and un-rotated at request_finished.
    rig.logits([SequenceChunk(prompt, 0, blocks)])
    rig.conn.request_finished(req, prompt, blocks)
    rig.pool.free(blocks)
    saved = lookup(rig.store, "t", "s")
    assert saved.token_ids == prompt
    nxt = [*prompt, 1, 2]
    req2 = Request("y", nxt, tenant="t", session_id="s")
    # 8 tokens already on the device (engine prefix cache): the store supplies the rest.
    assert rig.conn.num_external_tokens(req2, 8) == len(prompt) - 8
    blocks = rig.blocks(len(nxt))
    rig.logits([SequenceChunk(nxt[:8], 0, blocks)])  # stands in for the shared device blocks
    rig.conn.load(req2, 8, len(prompt) - 8, blocks)
    got = rig.logits([SequenceChunk(nxt[len(prompt) :], len(prompt), blocks)])[-1]
    torch.testing.assert_close(got, rig.recompute(nxt), rtol=1e-4, atol=1e-4)


def test_prompt_that_diverges_reuses_only_the_common_prefix(tmp_path):
    rig = Rig(tmp_path)
    prompt = list(range(60, 80))
    req = Request("x", prompt, tenant="t", session_id="s")
    rig.conn.num_external_tokens(req, 0)
    blocks = rig.blocks(len(prompt))
    rig.logits([SequenceChunk(prompt, 0, blocks)], ["x"])
    rig.conn.request_finished(req, prompt, blocks)
    rig.pool.free(blocks)
    rerendered = [*prompt[:15], 3, 3, 3]  # e.g. the last reply re-rendered differently
    req2 = Request("y", rerendered, tenant="t", session_id="s")
    assert rig.conn.num_external_tokens(req2, 0) == 15
    same = Request("z", prompt, tenant="t", session_id="s")
    assert rig.conn.num_external_tokens(same, 0) == len(prompt) - 1  # one token to compute
    other = Request("w", prompt, tenant="t", session_id=None)
    assert rig.conn.num_external_tokens(other, 0) == 0
