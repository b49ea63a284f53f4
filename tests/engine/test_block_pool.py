"""Block pool: ids, free list, ref counts; no leaks under random use."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chatstore.engine.block_pool import BlockPool, BlockPoolExhausted
from chatstore.engine.forward_batch import ForwardBatch, SequenceChunk
from chatstore.engine.kv_cache import PagedKVCache, blocks_for_budget, bytes_per_block
from chatstore.model.spec import ModelSpec
from tests.support.tiny_models import tiny_hf_model


def test_allocate_free_exact_ids() -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    assert pool.num_free == 1
    pool.free([0, 1])  # freed in reverse: the tail block 1 is reused before 0
    assert pool.allocate(3) == [3, 1, 0]
    assert pool.num_free == 0
    pool.check_integrity()


def test_exhaustion_raises_and_changes_nothing() -> None:
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(BlockPoolExhausted, match="2 blocks requested, 1 free of 3"):
        pool.allocate(2)
    assert pool.num_free == 1
    assert not pool.can_allocate(2) and pool.can_allocate(1)
    pool.check_integrity()


def test_shared_blocks_return_on_last_free() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.share(blocks)
    assert [pool.ref_count(b) for b in blocks] == [2, 2]
    pool.free(blocks)
    assert pool.num_free == 2
    pool.free(blocks)
    assert pool.num_free == 4
    pool.check_integrity()


def test_bad_frees_are_rejected_without_partial_state() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([a[0], 3])
    assert pool.ref_count(a[0]) == 1  # the good block was not freed either
    with pytest.raises(ValueError, match="freed 2 times"):
        pool.free([a[1], a[1]])
    with pytest.raises(ValueError, match="out of range"):
        pool.share([9])
    with pytest.raises(ValueError):
        BlockPool(0)
    pool.check_integrity()


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["alloc", "free", "share"]), st.integers(0, 9)), max_size=1000
    )
)
def test_no_leaks_under_random_sequences(ops) -> None:
    pool = BlockPool(16)
    held: list[list[int]] = []
    for op, n in ops:
        if op == "alloc":
            if pool.can_allocate(n):
                held.append(pool.allocate(n))
            else:
                with pytest.raises(BlockPoolExhausted):
                    pool.allocate(n)
        elif op == "share" and held:
            blocks = held[n % len(held)]
            pool.share(blocks)
            held.append(list(blocks))
        elif op == "free" and held:
            pool.free(held.pop(n % len(held)))
    pool.check_integrity()
    for blocks in held:
        pool.free(blocks)
    assert pool.num_free == pool.num_blocks
    pool.check_integrity()


def test_kv_cache_budget_and_layout() -> None:
    spec = ModelSpec.from_hf_config(tiny_hf_model("llama").config)
    per_block = bytes_per_block(spec, 16, torch.float32)
    assert per_block == 2 * 2 * 16 * 2 * 16 * 4  # K+V, layers, slots, kv heads, head dim, fp32
    assert blocks_for_budget(spec, 16, torch.float32, 10 * per_block + 5) == 10
    with pytest.raises(ValueError, match="holds no block"):
        blocks_for_budget(spec, 16, torch.float32, per_block - 1)
    kv = PagedKVCache(spec, 10, 16)
    assert kv.nbytes == 10 * per_block
    # One layer's K of one block is a contiguous slice (what layer-wise preload reads).
    assert kv.k(1)[3].is_contiguous()


def test_slot_mapping_and_errors() -> None:
    batch = ForwardBatch.build(
        [SequenceChunk([5, 6, 7], 2, [4, 9]), SequenceChunk([8], 5, [1, 3])], block_size=4
    )
    assert batch.positions.tolist() == [2, 3, 4, 5]
    assert batch.slot_mapping.tolist() == [4 * 4 + 2, 4 * 4 + 3, 9 * 4 + 0, 3 * 4 + 1]
    assert batch.logits_indices.tolist() == [2, 3]
    with pytest.raises(ValueError, match="need 2"):
        ForwardBatch.build([SequenceChunk([1, 2], 3, [0])], block_size=4)
    with pytest.raises(ValueError, match="at least one"):
        ForwardBatch.build([], block_size=4)


def test_take_revives_a_free_block_and_shares_a_used_one() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)  # [0, 1]
    pool.free([a[1]])  # block 1 is free again (its KV may still be cached)
    pool.take([1, 0])
    assert (pool.ref_count(0), pool.ref_count(1)) == (2, 1)
    assert pool.allocate(2) == [2, 3]  # block 1 is no longer on the free list
    with pytest.raises(ValueError, match="out of range"):
        pool.take([7])
    pool.check_integrity()
