"""Block manager: prefix hashing per tenant, ref-0 cached blocks in LRU order, copy-on-write."""

from __future__ import annotations

import torch

from chatstore.engine.block_manager import BlockManager
from chatstore.engine.block_pool import BlockPool
from chatstore.engine.kv_cache import PagedKVCache
from chatstore.engine.request import Request, SamplingParams
from chatstore.engine.sequence import RequestState, Sequence
from chatstore.model.spec import ModelSpec

B = 4  # block size


def make_manager(num_blocks: int = 8) -> BlockManager:
    spec = ModelSpec(
        architecture="LlamaForCausalLM",
        num_layers=1,
        hidden_size=8,
        intermediate_size=8,
        num_heads=1,
        num_kv_heads=1,
        head_dim=1,
        vocab_size=100,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_type="default",
        max_position_embeddings=128,
        qkv_bias=False,
        tie_word_embeddings=False,
        sliding_window=None,
        eos_token_ids=(1,),
    )
    kv = PagedKVCache(spec, num_blocks, B, torch.float32)
    return BlockManager(BlockPool(num_blocks), kv)


def make_seq(
    tokens: list[int], tenant: str = "t1", seq_id: int = 0, session_id: str | None = None
) -> Sequence:
    request = Request(f"r{seq_id}", tokens, SamplingParams(), tenant=tenant, session_id=session_id)
    group = RequestState(request)
    seq = Sequence(seq_id, group, 0)
    group.seqs.append(seq)
    return seq


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    """Pretend a forward computed every token of the sequence."""
    bm.reserve(seq, seq.num_tokens)
    seq.num_computed = seq.num_tokens
    bm.register_computed(seq)


SYSTEM = [10, 11, 12, 13, 14, 15, 16, 17]  # two full blocks


def test_same_tenant_shares_full_prompt_blocks() -> None:
    bm = make_manager()
    a = make_seq([*SYSTEM, 20, 21], seq_id=0)
    compute_all(bm, a)
    assert a.block_table == [0, 1, 2]
    b = make_seq([*SYSTEM, 30, 31, 32], seq_id=1)
    hit = bm.lookup(b)
    assert hit == [0, 1]
    bm.count_lookup(b, hit)
    bm.reserve(b, b.num_tokens, hit)
    assert b.block_table == [0, 1, 3]
    assert b.num_computed == 8
    assert [bm.pool.ref_count(i) for i in range(4)] == [2, 2, 1, 1]
    assert (bm.hits, bm.misses) == (2, 0)
    bm.free(a)
    bm.free(b)
    bm.pool.check_integrity()
    assert bm.pool.num_free == bm.pool.num_blocks


def test_tenants_never_share() -> None:
    bm = make_manager()
    compute_all(bm, make_seq([*SYSTEM, 20], tenant="alice", seq_id=0))
    other = make_seq([*SYSTEM, 20], tenant="bob", seq_id=1)
    assert bm.lookup(other) == []
    assert bm.lookup(make_seq([*SYSTEM, 20], tenant="alice", seq_id=2)) == [0, 1]


def test_last_token_is_always_computed() -> None:
    bm = make_manager()
    compute_all(bm, make_seq(SYSTEM, seq_id=0))
    # The same 8 tokens again: only the first block is reused, the second holds the last token.
    assert bm.lookup(make_seq(SYSTEM, seq_id=1)) == [0]


def test_finished_blocks_stay_cached_until_reused_in_lru_order() -> None:
    bm = make_manager(num_blocks=6)
    a = make_seq([*SYSTEM, 20, 21, 22, 23, 24], seq_id=0)  # 13 tokens: blocks 0,1,2 full + 3
    compute_all(bm, a)
    bm.free(a)
    assert bm.pool.num_free == 6
    stats = bm.stats()
    assert (stats.cached_blocks, stats.evictable_blocks) == (3, 3)
    # A seq freed in reverse: free list is [4, 5, 3, 2, 1, 0]; allocation takes uncached 4, 5 first
    # and then 3 (the uncached partial block), then evicts the cached tail block 2 before 1 and 0.
    c = make_seq(list(range(40, 56)), seq_id=1)
    bm.reserve(c, 16)
    assert c.block_table == [4, 5, 3, 2]
    assert bm.evictions == 1
    assert bm.lookup(make_seq([*SYSTEM, 20, 21, 22, 23, 24], seq_id=2)) == [0, 1]
    # Revived ref-0 blocks leave the free list; integrity holds.
    bm.free(c)
    d = make_seq([*SYSTEM, 20, 21], seq_id=3)
    hit = bm.lookup(d)
    bm.reserve(d, d.num_tokens, hit)
    assert d.block_table[:2] == [0, 1]
    bm.pool.check_integrity()


def test_fork_shares_then_copy_on_write() -> None:
    bm = make_manager()
    parent = make_seq([1, 2, 3, 4, 5, 6], seq_id=0)  # block 0 full, block 1 holds 2 of 4
    compute_all(bm, parent)
    bm.kv_cache.kv[:, :, 1] = 7.0
    child = parent.fork(1, 1)
    bm.fork(parent, child)
    assert [bm.pool.ref_count(b) for b in (0, 1)] == [2, 2]
    for s, tok in ((parent, 50), (child, 60)):
        s.token_ids.append(tok)
    assert bm.blocks_needed(child, 7) == 1  # the copy
    bm.reserve(child, 7)
    assert child.block_table == [0, 2]
    assert torch.equal(bm.kv_cache.kv[:, :, 2], bm.kv_cache.kv[:, :, 1])
    assert bm.blocks_needed(parent, 7) == 0  # now the only owner: writes in place
    bm.reserve(parent, 7)
    assert parent.block_table == [0, 1]
    assert [bm.pool.ref_count(b) for b in (0, 1, 2)] == [2, 1, 1]


def test_a_session_is_on_the_device_while_its_last_full_block_is_cached() -> None:
    bm = make_manager(num_blocks=6)
    first = [*SYSTEM, 20, 21, 22, 23, 24]  # 13 tokens: full blocks 0, 1, 2 and a partial 3
    a = make_seq(first, seq_id=0, session_id="s1")
    compute_all(bm, a)
    assert bm.stats().sessions == 1  # running: its computed blocks are cached
    bm.free(a)
    assert bm.stats().sessions == 1  # finished: still cached, its next turn would hit
    # Requests without a session are not followed; another session taking the shared system
    # prompt from the cache (and computing no full block of its own) counts at once.
    other = make_seq([50, 51, 52, 53, 54], seq_id=1)
    compute_all(bm, other)
    bm.free(other)
    b = make_seq([*SYSTEM, 30], seq_id=2, session_id="s2")
    hit = bm.lookup(b)
    assert hit == [0, 1]
    bm.reserve(b, b.num_tokens, hit)
    assert bm.stats().sessions == 2
    bm.free(b)
    # s1's next turn moves its tip further: still one session.
    a2 = make_seq([*first, 25, 26, 27, 28], seq_id=3, session_id="s1")
    hit = bm.lookup(a2)
    assert hit == [0, 1, 2]
    bm.reserve(a2, a2.num_tokens, hit)
    a2.num_computed = a2.num_tokens
    bm.register_computed(a2)
    assert bm.stats().sessions == 2
    bm.free(a2)
    # Pressure evicts s1's tail first (its tip), so s1 leaves the device; s2's tip, the
    # shared system prompt's last block, is evicted last.
    evicted = bm.evictions
    filler = make_seq(list(range(60, 76)), seq_id=4)  # 4 blocks
    bm.reserve(filler, 16)
    assert bm.evictions > evicted
    stats = bm.stats()
    assert stats.sessions == 1 and bm.lookup(make_seq([*SYSTEM, 30], seq_id=5)) == [0, 1]
    bm.free(filler)
    bm.reserve(make_seq(list(range(80, 104)), seq_id=6), 24)  # every block: all evicted
    assert bm.stats().sessions == bm.stats().cached_blocks == 0
    bm.pool.check_integrity()
