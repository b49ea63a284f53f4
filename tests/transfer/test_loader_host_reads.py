"""What the layer loader reads on the host, on a CPU: DRAM rows in place from the tier's pool
(leased blocks, no gather), LMDB values through the staging ring, int8 rows dequantised after
the copy. Every way must leave the device pool bit-identical to the rows written fresh; real
tiers, a real PagedKVCache and the loader's own copy (`finish` takes every layer)."""

from __future__ import annotations

import dataclasses
import random
from collections import deque

import pytest
import torch

from chatstore.engine.kv_cache import PagedKVCache
from chatstore.engine.rope import RotaryEmbedding, apply_rope
from chatstore.model.weights import RopeParameters
from chatstore.store import kv_quant
from chatstore.store.session_kv import ChunkKey, SessionKV
from chatstore.store.tiers.base import TierFull
from chatstore.store.tiers.dram import DramTier, TokenKVShape
from chatstore.store.tiers.dram_rows import PooledRows
from chatstore.store.tiers.lmdb import LmdbTier
from chatstore.transfer.chunked_kv import ChunkedKV
from chatstore.transfer.copy_events import layer_events
from chatstore.transfer.layer_copy import layer_to_device
from chatstore.transfer.layer_loader import LayerLoader, LoadJob
from chatstore.transfer.pinned_staging import ALIGN, StagingRing
from chatstore.transfer.read_buffer import ReadBuffer
from tests.support.store import TINY_SPEC

L, H, D, B, C = 3, 2, 8, 4, 12  # layers, KV heads, head dim, DRAM block, chunk tokens
T = 3 * C
CPU = torch.device("cpu")
SPEC = dataclasses.replace(TINY_SPEC, num_layers=L, num_kv_heads=H, head_dim=D)


def history(dtype: torch.dtype = torch.float32) -> SessionKV:
    kv = torch.randn(L, 2, T, H, D, generator=torch.Generator().manual_seed(3))
    return SessionKV(list(range(T)), kv_quant.convert(kv, dtype))


def chunk_keys() -> list[ChunkKey]:
    return [ChunkKey("t", f"{i:064x}") for i in range(T // C)]


def dram(dtype: torch.dtype, in_place: bool, value: SessionKV, scattered: bool = True) -> DramTier:
    """The chunks in a DRAM tier whose blocks were handed out in no order (or in order)."""
    layout = TokenKVShape(L, H, D, dtype)
    tier = DramTier(64 * layout.bytes_per_token * B, layout, B, pin=False, read_in_place=in_place)
    if scattered:
        tier._free = deque(random.Random(1).sample(list(tier._free), len(tier._free)))
    for i, key in enumerate(chunk_keys()):
        tier.put(
            key, SessionKV(value.token_ids[i * C : (i + 1) * C], value.kv[:, :, i * C :][:, :, :C])
        )
    return tier


def lmdb(tmp_path, value: SessionKV) -> LmdbTier:
    tier = LmdbTier(tmp_path / "kv.lmdb", 1 << 24, "fp")
    for i, key in enumerate(chunk_keys()):
        tier.put(
            key, SessionKV(value.token_ids[i * C : (i + 1) * C], value.kv[:, :, i * C :][:, :, :C])
        )
    return tier


def read(tiers: list, start: int, end: int) -> ChunkedKV:
    """Rows [start, end) as the store's read_span gives them: chunk i from tiers[i]."""
    parts = []
    for i, key in enumerate(chunk_keys()):
        a, b = max(start, i * C), min(end, (i + 1) * C)
        if a < b:
            tier = tiers[i]
            value = tier.get_rows(key, a - i * C, b - i * C) if isinstance(tier, DramTier) else None
            if value is None:
                whole = tier.get(key)
                value = SessionKV(
                    whole.token_ids[a - i * C : b - i * C], whole.kv[:, :, a - i * C : b - i * C]
                )
            parts.append((value, a))
    return ChunkedKV(parts, start, end, list(range(T)))


def loader(staging: StagingRing | None = None) -> LayerLoader:
    cache = PagedKVCache(SPEC, num_blocks=16, block_size=4, dtype=torch.float32)
    rope = RotaryEmbedding(RopeParameters(10000.0), D, CPU)
    return LayerLoader(
        cache, rope, lambda key: None, ReadBuffer(0, 0), threads=None, staging=staging
    )


def load(ld: LayerLoader, saved: ChunkedKV, start: int, end: int) -> torch.Tensor:
    slots = torch.randperm(16 * 4, generator=torch.Generator().manual_seed(5))[: end - start]
    job = LoadJob("r", saved, start, end, slots, layer_events(CPU, L))
    ld.finish(job)  # every layer copied here, on this thread, as the forward would
    assert job.error is None
    return ld.kv_cache.kv.clone()


def written_fresh(value: SessionKV, start: int, end: int) -> torch.Tensor:
    """The pool after writing the rows straight from the value, as a fresh prefill would."""
    ld = loader()
    cos, sin = ld.rope.cos_sin(torch.arange(start, end), torch.float32)
    slots = torch.randperm(16 * 4, generator=torch.Generator().manual_seed(5))[: end - start]
    for layer in range(L):
        k, v = (kv_quant.convert(value.kv[layer, i, start:end], torch.float32) for i in (0, 1))
        ld.kv_cache.write(layer, apply_rope(k, cos, sin), v, slots)
    return ld.kv_cache.kv.clone()


SPANS = [(0, T), (5, T - 3), (C + 1, C + 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize(("start", "end"), SPANS)
def test_dram_in_place_fills_the_pool_as_the_copy_does(dtype, start, end) -> None:
    value = history(dtype)
    want = written_fresh(value, start, end)
    in_place = read([dram(dtype, True, value)] * 3, start, end)
    assert all(isinstance(v, PooledRows) for v, _ in in_place.parts)
    copied = read([dram(dtype, False, value)] * 3, start, end)
    assert not any(isinstance(v, PooledRows) for v, _ in copied.parts)
    assert torch.equal(load(loader(), in_place, start, end), want)
    assert torch.equal(load(loader(), copied, start, end), want)


@pytest.mark.parametrize(("start", "end"), SPANS)
def test_chunks_adjacent_in_the_pool_cross_in_one_copy_a_layer(start, end) -> None:
    """A session's chunks saved in order sit in consecutive blocks: one copy a layer for all of
    them, planned once for the span (the host's work per copy is what a GPU load costs)."""
    value = history()
    saved = read([dram(torch.float32, True, value, scattered=False)] * 3, start, end)
    for layer in range(L):
        rows = layer_to_device(saved, layer, start, end, CPU, None)
        assert rows.pooled_runs == 1
        k, v = saved.layer(layer, start, end)
        assert torch.equal(rows.k, k) and torch.equal(rows.v, v)
    assert list(saved.copy_plans) == [(start, end)]
    scattered = read([dram(torch.float32, True, value)] * 3, start, end)
    rows = layer_to_device(scattered, 1, start, end, CPU, None)
    assert rows.pooled_runs > 1 or end - start <= B  # blocks in no order: a copy per run
    assert torch.equal(rows.k, scattered.layer(1, start, end)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize(("start", "end"), SPANS)
def test_lmdb_through_the_staging_ring_fills_the_pool_as_the_copy_does(
    tmp_path, dtype, start, end
) -> None:
    value = history(dtype)
    want = written_fresh(value, start, end)
    tier = lmdb(tmp_path, value)
    ring = StagingRing(32 * ALIGN, pin=False)
    assert torch.equal(load(loader(ring), read([tier] * 3, start, end), start, end), want)
    assert ring.served == L and ring.refused == 0 and ring.in_use() == 0
    plain = loader(None)  # no ring (a CPU's default): plain copies, the same pool
    assert torch.equal(load(plain, read([tier] * 3, start, end), start, end), want)


def test_a_layer_larger_than_the_ring_is_copied_plainly(tmp_path) -> None:
    value = history()
    tier = lmdb(tmp_path, value)
    ring = StagingRing(ALIGN, pin=False)  # a layer of 36 rows is 2 x 36 x 2 x 8 x 4 bytes
    assert torch.equal(load(loader(ring), read([tier] * 3, 0, T), 0, T), written_fresh(value, 0, T))
    assert ring.served == 0 and ring.refused == L


def test_dram_lmdb_and_int8_mixed_in_one_load(tmp_path) -> None:
    """Chunk 0 in DRAM in place, chunk 1 on LMDB, chunk 2 a DRAM copy (both through the ring)."""
    value = history(torch.int8)
    tiers = [dram(torch.int8, True, value), lmdb(tmp_path, value), dram(torch.int8, False, value)]
    saved = read(tiers, 3, T - 1)
    rows = layer_to_device(saved, 1, 3, T - 1, CPU, StagingRing(32 * ALIGN, pin=False))
    k, v = saved.layer(1, 3, T - 1)  # the gathered path, for comparison
    assert torch.equal(rows.k, k) and torch.equal(rows.v, v)
    assert rows.pooled_runs >= 1 and rows.plain_rows == 0
    assert rows.staged_rows == C + (T - 1 - 2 * C)  # every value not read in place
    ring = StagingRing(32 * ALIGN, pin=False)
    assert torch.equal(load(loader(ring), saved, 3, T - 1), written_fresh(value, 3, T - 1))


def test_leased_blocks_are_not_reused_until_the_rows_are_dropped() -> None:
    value = history()
    tier = dram(torch.float32, True, value)
    key = chunk_keys()[0]
    rows = tier.get_rows(key, 2, C)
    assert isinstance(rows, PooledRows) and tier.leased_blocks() == 3
    want = value.kv[:, :, 2:C].clone()
    used = tier.used_bytes()
    assert tier.delete(key)
    assert tier.used_bytes() == used  # parked, still counted: nothing can take them
    tier.check_integrity()
    free = tier.num_blocks - 9  # 3 chunks of 3 blocks were put
    with pytest.raises(TierFull):  # the parked blocks are not free
        tier.put(ChunkKey("t", "f" * 64), zeros(free * B + 1))
    tier.put(ChunkKey("t", "f" * 64), zeros(free * B))  # every free block, no parked one
    assert torch.equal(rows.kv, want)  # gathered now, after the put: still the rows
    del rows
    assert tier.leased_blocks() == 0
    assert tier.used_bytes() == (tier.num_blocks - 3) * tier.block_bytes
    tier.check_integrity()


def zeros(tokens: int) -> SessionKV:
    return SessionKV([0] * tokens, torch.zeros(L, 2, tokens, H, D))


def test_extending_into_a_leased_partial_block_is_refused() -> None:
    value = history()
    tier = dram(torch.float32, True, value)
    base, new = chunk_keys()[0], ChunkKey("t", "e" * 64)
    rows = tier.get_rows(base, 0, C)
    extra = SessionKV([99] * 2, torch.ones(L, 2, 2, H, D))
    assert not tier.extend(base, new, 6, extra)  # 6 % B != 0: would write rows 6.. of block 1
    assert tier.contains(base) and torch.equal(rows.kv, value.kv[:, :, :C])
    rows.release()
    assert tier.extend(base, new, 6, extra)
    tier.check_integrity()
    with pytest.raises(RuntimeError, match="lease"):
        rows.block_runs(0, 1)
