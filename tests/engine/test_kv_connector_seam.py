"""The KVConnector seam: when the engine asks, loads, streams saves and reports the end."""

from __future__ import annotations

import pytest
import torch

from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.kv_connector import KVConnector
from chatstore.engine.llm_engine import LLMEngine
from chatstore.engine.request import Request, SamplingParams
from tests.support.engine import (
    assert_pool_clean,
    greedy,
    prompt,
    run_all,
    tiny_runtime,
    tokens_of,
)

pytestmark = pytest.mark.usefixtures("single_thread")

B = 4


class RecordingConnector(KVConnector):
    """Keeps each finished request's (post-RoPE) KV by token prefix; serves it back on demand."""

    saves_kv = True

    def __init__(self, engine_ref: list[LLMEngine]) -> None:
        self.engine_ref = engine_ref
        self.saved: dict[tuple[int, ...], torch.Tensor] = {}  # tokens -> kv [L, 2, T, Hkv, D]
        self.events: list[tuple] = []
        self.row_ids: list[list[str]] = []

    @property
    def kv(self) -> torch.Tensor:
        return self.engine_ref[0].runtime.kv_cache.kv

    def num_external_tokens(self, request: Request, num_computed: int) -> int:
        self.events.append(("ask", request.request_id, num_computed))
        for tokens in self.saved:
            if tuple(request.prompt_token_ids[: len(tokens)]) == tokens:
                return len(tokens) - num_computed
        return 0

    def load(self, request: Request, start: int, num_tokens: int, block_table: list[int]) -> None:
        self.events.append(("load", request.request_id, start, num_tokens))
        for tokens, kv in self.saved.items():
            if tuple(request.prompt_token_ids[: len(tokens)]) == tokens:
                for p in range(start, start + num_tokens):
                    self.kv[:, :, block_table[p // B], p % B] = kv[:, :, p]
                return
        raise AssertionError("asked to load KV it does not have")

    def save_layer(self, layer, k_pre_rope, v, batch) -> None:
        assert len(batch.request_ids) == batch.num_seqs
        self.events.append(("save", layer, k_pre_rope.shape[0]))
        self.row_ids.append(list(batch.request_ids))

    def request_finished(self, request: Request, token_ids: list[int], block_table: list[int]):
        pool = self.engine_ref[0].runtime.pool
        assert all(pool.ref_count(b) > 0 for b in block_table)  # still held during the call
        self.events.append(("finished", request.request_id, len(token_ids)))
        slots = [block_table[p // B] * B + p % B for p in range(len(token_ids))]
        flat = self.kv.flatten(2, 3)  # [L, 2, N*B, Hkv, D]
        self.saved[tuple(token_ids)] = flat[:, :, slots].clone()


def test_connector_supplies_history_kv_and_outputs_do_not_change() -> None:
    first = prompt(1, 13)
    # Turn 1 in engine A: the connector records the KV of prompt + output at the end.
    ref: list[LLMEngine] = []
    conn = RecordingConnector(ref)
    a = LLMEngine(tiny_runtime(), EngineConfig(enable_prefix_cache=False), conn)
    ref.append(a)
    a.add_request(Request("t1", first, greedy(5)))
    out1 = tokens_of(run_all(a)["t1"])
    assert ("finished", "t1", 13 + 4) in conn.events  # the last token has no KV yet
    saves = [e for e in conn.events if e[0] == "save"]
    assert len(saves) == 2 * 5 and saves[0] == ("save", 0, 13)  # 2 layers x 5 forwards
    # Turn 2 in a fresh engine B: history comes from the connector, only the new tokens run.
    history = list(first) + out1[:4]
    second = [*history, 7, 8, 9]
    b_ref: list[LLMEngine] = []
    conn_b = RecordingConnector(b_ref)
    conn_b.saved = conn.saved
    b = LLMEngine(tiny_runtime(), EngineConfig(enable_prefix_cache=False), conn_b)
    b_ref.append(b)
    b.add_request(Request("t2", second, greedy(6)))
    outs = run_all(b)["t2"]
    assert conn_b.events[:2] == [("ask", "t2", 0), ("load", "t2", 0, 17)]
    assert outs[-1].usage.cached_tokens == 17
    assert b.stats().tokens_computed == 3 + 5
    plain = LLMEngine(tiny_runtime(), EngineConfig())
    plain.add_request(Request("t2", second, greedy(6)))
    assert tokens_of(outs) == tokens_of(run_all(plain)["t2"])
    assert_pool_clean(b)


def test_failing_load_ends_the_request_with_an_error() -> None:
    class Broken(RecordingConnector):
        def num_external_tokens(self, request, num_computed):
            return 8 if request.request_id == "x" else 0

        def load(self, request, start, num_tokens, block_table):
            raise OSError("disk on fire")

    ref: list[LLMEngine] = []
    engine = LLMEngine(tiny_runtime(), EngineConfig(), Broken(ref))
    ref.append(engine)
    engine.add_request(Request("x", prompt(2, 12), greedy(3)))
    engine.add_request(Request("y", prompt(3, 5), greedy(3)))
    outs = run_all(engine)
    assert outs["x"][-1].samples[-1].finish_reason == "error"
    assert "disk on fire" in (outs["x"][-1].error or "")
    assert len(tokens_of(outs["y"])) == 3
    assert_pool_clean(engine)


def test_save_layer_rows_name_their_request_and_sample() -> None:
    ref: list[LLMEngine] = []
    conn = RecordingConnector(ref)
    engine = LLMEngine(tiny_runtime(), EngineConfig(), conn)
    ref.append(engine)
    params = SamplingParams(max_tokens=2, temperature=1.0, seed=1, n=2, ignore_eos=True)
    engine.add_request(Request("m", prompt(4, 6), params))
    run_all(engine)
    assert conn.row_ids[0] == ["m"] and conn.row_ids[-1] == ["m", "m#1"]
    assert [e for e in conn.events if e[0] == "finished"] == [("finished", "m", 7)]
    assert_pool_clean(engine)
