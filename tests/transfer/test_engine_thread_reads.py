"""No disk or network read on the engine thread, and KV below usable however small the tiers
above it (issue 23 item 4).

The engine's admission read (StoreConnector.num_external_tokens) reads host memory only. A
chunk that only SSD (LMDB) or Redis holds is read by the API thread that opens the turn
(`open_turn`, whose handle rides on the request): promoted into DRAM, or kept beside it when
there is no DRAM tier or it cannot take it. A turn nobody opened recomputes what only a slow
tier holds rather than stall every running decode on a ~12 MB disk read.

Reads are counted by the name of the thread that made them: LMDB reads through the real tier's
`get`, Redis commands on the real sockets (tests/support/redis_faults.py). A tiny random model
(tests/support/tiny_models.py) and a real redis-server; every reuse is checked against a full
recompute.
"""

from __future__ import annotations

import base64
import collections
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
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
from tests.support.redis_faults import redis_sends
from tests.support.store import held_bytes
from tests.support.tiny_models import tiny_hf_model

BLOCK = 4  # tokens per device and DRAM block
CHUNK = 8  # tokens per stored chunk
TENANT = "t"
ENGINE = "chatstore-engine"  # the engine loop's thread name (async_engine.py)
API = "chatstore-api-worker"


@pytest.fixture(scope="module")
def model():
    return tiny_hf_model("qwen2", seed=3)


def on_thread(name: str, fn: Callable[[], Any]) -> Any:
    """fn() on a thread of that name; its result (or its exception, raised here)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # handed to the caller
            out["error"] = exc

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join(120)
    if "error" in out:
        raise out["error"]
    return out["value"]


class Replica:
    """A tiny model's device pool and connector over a store of the given tiers."""

    def __init__(self, model, data_dir: Path, chunks_dram: int, **settings: Any) -> None:
        self.spec = ModelSpec.from_hf_config(model.config)
        self.cache = PagedKVCache(self.spec, 400, BLOCK)
        self.pool = BlockPool(400)
        self.runner = ModelRunner(model, self.spec, self.cache)
        token_bytes = 2 * self.spec.num_layers * self.spec.num_kv_heads * self.spec.head_dim * 4
        self.chunk_bytes = CHUNK * token_bytes
        data_dir.mkdir(parents=True, exist_ok=True)
        config = StoreSettings(
            data_dir=data_dir,
            dram_bytes=chunks_dram * self.chunk_bytes,
            block_size=BLOCK,
            chunk_tokens=CHUNK,
            **settings,
        )
        self.store = AttentionStore(config, self.spec, "tiny")
        self.conn = StoreConnector(self.store, self.cache, self.runner.rope)
        self._n = 0

    def close(self) -> None:
        self.conn.close()
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

    def step(self, sid: str, prompt: list[int], opened=None) -> tuple[int, torch.Tensor]:
        """The engine's part of a turn (`opened`: the API's handle of it): admission (how many
        prompt tokens the store supplies, read here), the load, the prefill of the rest, the
        save; (reused, last logits)."""
        self._n += 1
        req = Request(f"r{self._n}", list(prompt), tenant=TENANT, session_id=sid)
        req.store_turn = opened
        cached = self.conn.num_external_tokens(req, 0)
        blocks = self.pool.allocate(-(-(len(prompt) + 1) // BLOCK))
        if cached:
            self.conn.load(req, 0, cached, blocks)
        logits = self.forward(SequenceChunk(prompt[cached:], cached, blocks), req.request_id)
        self.conn.request_finished(req, list(prompt), blocks)
        self.pool.free(blocks)
        return cached, logits

    def chunks(self, sid: str) -> list:
        chain = self.store.index.get(SessionKey(TENANT, sid))
        assert chain is not None
        return list(chain.chunks)


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 256, (n,), generator=g).tolist()


def assert_same_answer(replica: Replica, logits: torch.Tensor, prompt: list[int]) -> None:
    want = replica.recompute(prompt)
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    assert int(logits.argmax()) == int(want.argmax())  # the same greedy token


# -- SSD ----------------------------------------------------------------------------------------


def test_no_lmdb_read_on_the_engine_thread(tmp_path, model, monkeypatch):
    """Two sessions whose chunks only LMDB holds. The one whose turn the API opened is read
    on the API's thread and reused whole; the other is recomputed. The engine's thread reads
    LMDB for neither (before: each chunk was read from disk there, at admission)."""
    replica = Replica(model, tmp_path, chunks_dram=16, ssd_bytes=64 << 20, persist="off")
    try:
        store = replica.store
        histories = {"opened": tokens(4 * CHUNK, seed=1), "cold": tokens(3 * CHUNK, seed=2)}
        for sid, history in histories.items():
            assert on_thread(ENGINE, lambda h=history, s=sid: replica.step(s, h))[0] == 0
            for chunk in replica.chunks(sid):  # only on SSD, as DRAM evictions leave them
                assert store.tiers.persist(chunk)
                with store.tiers.lock:
                    store.tier("dram").delete(chunk)
                assert store.tiers.where(chunk) == "ssd"

        ssd = store.tier("ssd")
        reads: collections.Counter[str] = collections.Counter()
        get = ssd.get

        def counting_get(key):
            reads[threading.current_thread().name] += 1
            return get(key)

        monkeypatch.setattr(ssd, "get", counting_get)

        opened = on_thread(API, lambda: store.open_turn(TENANT, "opened"))
        assert reads[API] == 4
        prompt = [*histories["opened"], 7, 8, 9]
        cached, logits = on_thread(ENGINE, lambda: replica.step("opened", prompt, opened))
        assert cached == len(histories["opened"])
        assert_same_answer(replica, logits, prompt)

        prompt = [*histories["cold"], 5, 6]
        cached, logits = on_thread(ENGINE, lambda: replica.step("cold", prompt))
        assert cached == 0  # recomputed, not read from disk here
        assert_same_answer(replica, logits, prompt)

        assert reads[ENGINE] == 0, dict(reads)
        assert not store.pins and held_bytes(store) == 0
    finally:
        replica.close()


# -- Redis, no tier (or a small one) above it --------------------------------------------------


@pytest.mark.parametrize("chunks_dram", [0, 2], ids=["no-dram", "dram-of-2-chunks"])
def test_a_replica_without_local_tiers_reuses_a_session_begun_on_another(
    tmp_path, model, redis_url, monkeypatch, chunks_dram
):
    """Two replicas over one Redis (chunks and records), the second with `ssd_bytes = 0` and
    no DRAM tier, or one smaller than the session: a session begun on the first is reused
    whole by the second's next turn (before: 0 tokens, remote chunks were used only after a
    promotion into a DRAM tier that was not there), with the same answer as a full
    recompute, and no Redis command sent from the engine's thread."""
    shared = dict(
        redis_url=redis_url,
        redis_bytes=64 << 20,
        ssd_bytes=0,
        secret_key="k1:" + base64.b64encode(bytes(range(32))).decode(),  # one for both
    )
    first = Replica(model, tmp_path / "one", 16, persist="write_through", **shared)
    second = None
    try:
        history = tokens(5 * CHUNK, seed=3)
        assert on_thread(ENGINE, lambda: first.step("s", history))[0] == 0
        first.store.wait_saved(TENANT, "s")
        remote = first.store.tier("remote")
        for chunk in first.chunks("s"):
            assert remote.contains(chunk), f"chunk {chunk} did not reach Redis"

        second = Replica(  # its turns saved on the writer thread, as in the server
            model, tmp_path / "two", chunks_dram, persist="off", async_save=True, **shared
        )
        prompt = [*history, 11, 12, 13]
        with redis_sends(monkeypatch) as sends:
            opened = on_thread(API, lambda: second.store.open_turn(TENANT, "s"))
            assert opened.from_remote == 5
            cached, logits = on_thread(ENGINE, lambda: second.step("s", prompt, opened))
        assert cached == len(history)
        assert_same_answer(second, logits, prompt)
        assert sends[API] > 0 and sends[ENGINE] == 0, dict(sends)
        assert not second.store.pins and held_bytes(second.store) == 0
        if chunks_dram:
            second.store.tiers.check_capacity()
    finally:
        first.close()
        if second is not None:
            second.close()
