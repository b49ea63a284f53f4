"""A store in 8-token chunks, and turns whose KV is a pure function of (token id, position): a
chunk's content is then fixed by its tokens and its place in the history, as real KV is by the
chain its key hashes, so the exact bytes every read must return are known (kv_of)."""

from __future__ import annotations

import torch

from chatstore.store.attention_store import AttentionStore
from chatstore.store.ports import ChunkDelta
from chatstore.store.session_kv import SessionKV
from chatstore.store.settings import StoreSettings
from tests.support.store import TINY_SPEC, TOKEN_BYTES

CHUNK = 8


def kv_of(token_ids: list[int], start: int = 0) -> torch.Tensor:
    """[L, 2, T, H, D] determined by each token's id and position."""
    ids = torch.tensor(token_ids, dtype=torch.float32)
    pos = torch.arange(start, start + len(token_ids), dtype=torch.float32)
    base = (ids * 1000 + pos).view(1, 1, -1, 1, 1)
    grid = torch.arange(2 * 2 * 2 * 4, dtype=torch.float32).view(2, 2, 1, 2, 4)
    return base + grid / 100


def make(tmp_path, **kw) -> AttentionStore:
    """A store of TINY_SPEC in CHUNK-token chunks: six chunks of DRAM, 4 MiB of SSD, no
    write-back unless asked."""
    kw.setdefault("dram_bytes", 6 * CHUNK * TOKEN_BYTES)
    kw.setdefault("ssd_bytes", 1 << 22)
    kw.setdefault("block_size", 4)
    kw.setdefault("chunk_tokens", CHUNK)
    kw.setdefault("persist", "off")
    return AttentionStore(StoreSettings(data_dir=tmp_path, **kw), TINY_SPEC, "fp")


def turn(store: AttentionStore, tenant: str, sid: str, token_ids: list[int]) -> None:
    """A turn whose history is token_ids: what the connector does, values from kv_of."""
    stored = store.find(tenant, sid)
    reusable = 0
    if stored is not None:
        n = min(len(stored.token_ids), len(token_ids))
        while reusable < n and stored.token_ids[reusable] == token_ids[reusable]:
            reusable += 1
    plan = store.plan_turn(tenant, token_ids, stored, reusable)

    def build() -> dict:
        out = {}
        for _, k, a, b in plan.new_spans():
            base, keep = plan.bases.get(k, (None, 0))
            rows = SessionKV(token_ids[a + keep : b], kv_of(token_ids[a + keep : b], a + keep))
            out[k] = rows if base is None else ChunkDelta(base, keep, rows)
        return out

    new_tokens = sum(b - a for _, _, a, b in plan.new_spans())
    store.save_plan(tenant, sid, plan, build, new_tokens * TOKEN_BYTES)
