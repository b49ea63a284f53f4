"""vAttention layout: reserved address space, pages committed on demand, slots of contiguous KV.

The OS-level pieces (commit, release, RSS), the slot pool's bookkeeping, the runner's SDPA
attention over slots against transformers, and the memory bound over a random arrival/finish
sequence through the real engine."""

from __future__ import annotations

import random

import pytest
import torch

from chatstore.engine.block_pool import BlockPoolExhausted
from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.forward_batch import ForwardBatch, SequenceChunk
from chatstore.engine.kv_cache import bytes_per_block
from chatstore.engine.llm_engine import LLMEngine
from chatstore.engine.request import Request
from chatstore.engine.runner import ModelRunner
from chatstore.engine.vattention import create_virtual_kv
from chatstore.engine.vattention.slot_pool import SlotBlockPool
from chatstore.engine.vattention.virtual_memory import BASE_PAGE, VirtualRegion
from chatstore.model.spec import ModelSpec
from tests.support.engine import (
    assert_pool_clean,
    greedy,
    prompt,
    tiny_runtime,
)
from tests.support.tiny_models import TINY_ARCHS, tiny_hf_model

pytestmark = pytest.mark.usefixtures("single_thread")

TOL = 1e-4


def test_region_commits_on_demand_and_gives_pages_back() -> None:
    region = VirtualRegion(256 << 20)  # 256 MB of address space, no memory
    t = region.tensor(torch.float32)
    assert t.numel() == (256 << 20) // 4 and region.rss_bytes() == 0
    region.commit(0, 3 * BASE_PAGE)
    assert region.rss_bytes() == 3 * BASE_PAGE
    t[(10 * BASE_PAGE) // 4] = 1.0  # a write faults one more page in
    assert region.rss_bytes() == 4 * BASE_PAGE
    assert float(t[100 << 18 : (100 << 18) + 1024].sum()) == 0.0  # reads map the zero page
    assert region.rss_bytes() == 4 * BASE_PAGE
    region.release(0, 16 * BASE_PAGE)
    assert region.rss_bytes() == 0 and float(t[(10 * BASE_PAGE) // 4]) == 0.0
    with pytest.raises(ValueError, match="aligned"):
        region.commit(1, BASE_PAGE)
    region.close()


def test_slot_pool_hands_out_low_slots_and_frees_a_slot_with_its_last_reference() -> None:
    pool = SlotBlockPool(num_slots=3, blocks_per_slot=8, budget_blocks=12)
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert a == [0, 1] and b == [8, 9, 10]
    assert pool.extend(0, 2) == [2, 3] and pool.num_free == 12 - 7
    pool.share(a)  # an n > 1 sibling still reads slot 0's first blocks
    pool.free([0, 1, 2, 3])
    assert pool.num_free_slots == 1  # slot 0 is still referenced
    pool.free(a)
    assert pool.num_free_slots == 2 and pool.allocate(1) == [0]  # lowest free slot again
    with pytest.raises(BlockPoolExhausted, match="slot holds 8"):
        pool.extend(1, 6)
    assert pool.allocate(7) == list(range(16, 23)) and pool.num_free == 1
    with pytest.raises(BlockPoolExhausted, match="budget"):
        pool.extend(1, 2)
    with pytest.raises(BlockPoolExhausted, match="slots are in use"):
        pool.allocate(1)
    pool.check_integrity()


def _slot_runner(model, dtype=torch.float32, slots: int = 8, attention: str = "auto"):
    spec = ModelSpec.from_hf_config(model.config)
    kv, pool = create_virtual_kv(spec, slots, 4 << 20, block_size=8, dtype=dtype)
    return ModelRunner(model, spec, kv, attention), pool


def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_slot_logits_match_transformers_whole_and_on_history(arch: str) -> None:
    model = tiny_hf_model(arch, seed=3)
    runner, pool = _slot_runner(model)
    ids = torch.randint(0, 256, (61,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = _hf_logits(model, ids)
    whole = pool.allocate(8)
    batch = ForwardBatch.build([SequenceChunk(ids, 0, whole)], 8, all_logits=True)
    assert (runner.forward(batch) - ref).abs().max().item() <= TOL
    for split in (1, 13, 40, 60):  # a new turn on KV already in the slot
        blocks = pool.allocate(8)
        head = ForwardBatch.build([SequenceChunk(ids[:split], 0, blocks)], 8, all_logits=True)
        tail = ForwardBatch.build([SequenceChunk(ids[split:], split, blocks)], 8, all_logits=True)
        got = torch.cat([runner.forward(head), runner.forward(tail)])
        assert (got - ref).abs().max().item() <= TOL, split
        pool.free(blocks)
    pool.free(whole)
    pool.check_integrity()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_slot_decode_equals_the_decode_alone(dtype: torch.dtype) -> None:
    """Decode batched over a strided view of the slots (a live slot not in the batch in the
    range) gives each sequence what it gets alone: the same bits in bf16 (the flash kernel sees
    key counts aligned to 16), fp32 within the rounding of the batched GEMMs."""
    model = tiny_hf_model("llama", seed=5).to(dtype)
    runner, pool = _slot_runner(model, dtype)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, 256, (n,), generator=gen).tolist() for n in (1, 5, 17, 30, 9)]

    def run(group: list[int], hole: bool) -> dict[int, list[torch.Tensor]]:
        gap = pool.allocate(1) if hole else None  # a live slot that is not in the batch
        tables = {i: pool.allocate(8) for i in group}
        chunks = [SequenceChunk(prompts[i], 0, tables[i]) for i in group]
        out: dict[int, list[torch.Tensor]] = {i: [] for i in group}
        logits = runner.forward(ForwardBatch.build(chunks, 8))
        for _ in range(10):
            tokens = torch.argmax(logits, dim=-1).tolist()
            for i, row in zip(group, logits, strict=True):
                out[i].append(row)
            chunks = [
                SequenceChunk([t], c.context_len, c.block_table)
                for t, c in zip(tokens, chunks, strict=True)
            ]
            logits = runner.forward(ForwardBatch.build(chunks, 8))
        for t in tables.values():
            pool.free(t)
        if gap:
            pool.free(gap)
        return out

    together = run([4, 0, 2, 1, 3], hole=True)
    for i in range(5):
        alone = run([i], hole=False)[i]
        diff = max((a - b).abs().max().item() for a, b in zip(alone, together[i], strict=True))
        assert diff <= (1e-5 if dtype == torch.float32 else 0.0), i
    pool.check_integrity()


def _decode_until(engine: LLMEngine) -> None:
    for _ in range(10_000):
        if not engine.has_work():
            return
        engine.step()


def test_committed_memory_stays_within_a_page_per_live_buffer() -> None:
    """Over random arrivals and finishes (idle pages given back at once: watermark 0), the
    mapping's RSS is at least the KV in use and less than one page more per live sequence and
    layer K/V buffer; then every page goes back.

    Accounting, between steps: a live sequence uses u = min(num_computed + 1, num_tokens)
    tokens (the KV it holds plus the token the next step writes, which the committer makes
    resident ahead of it), u * token_bytes in each of the 2L per-layer K and V buffers of its
    slot; each buffer commits ceil(u * token_bytes / page) pages."""
    runtime = tiny_runtime(num_blocks=256, block_size=4, layout="vattention")
    cache, pool = runtime.kv_cache, runtime.pool
    cache.pages.watermark_bytes = 0
    engine = LLMEngine(runtime, EngineConfig(max_tokens_per_step=64))
    buffers, page, tb = 2 * runtime.model.spec.num_layers, cache.region.page_size, cache.token_bytes
    rng = random.Random(4)
    pending = [
        Request(f"r{i}", prompt(300 + i, rng.randint(5, 120)), greedy(rng.randint(1, 60)))
        for i in range(24)
    ]
    steps = 0
    while pending or engine.has_work():
        while pending and rng.random() < 0.3:
            engine.add_request(pending.pop(0))
        engine.step()
        steps += 1
        cache.pages.drain()
        live = [s for s in engine.scheduler.running if s.block_table]
        assert len(live) == pool.num_slots - pool.num_free_slots
        used = sum(min(s.num_computed + 1, s.num_tokens) for s in live) * tb * buffers
        held = sum(s.num_computed for s in live) * tb * buffers
        rss = cache.rss_bytes()
        # Strictly less than a page of slack per live buffer: at most page - 1 bytes each.
        slack = len(live) * buffers * (page - 1)
        assert held <= rss <= used + slack, (steps, rss, used, len(live))
        assert rss == cache.nbytes  # the committer's books are the OS's
    assert steps > 50 and not pending
    assert_pool_clean(engine)
    assert cache.rss_bytes() == 0  # watermark 0: every finished slot gave its pages back
    cache.pages.watermark_bytes = 1 << 30


def test_finished_slot_keeps_its_pages_for_the_next_request() -> None:
    """Deferred reclamation: the next request takes the lowest slot, pages and all; a sequence
    decoding past a page boundary finds its next page committed by the background thread."""
    runtime = tiny_runtime(num_blocks=256, block_size=4, layout="vattention")
    pages = runtime.kv_cache.pages
    engine = LLMEngine(runtime, EngineConfig())
    first = Request("a", prompt(1, 40), greedy(120))
    engine.add_request(first)
    _decode_until(engine)
    held = pages.committed_bytes()
    assert held > 0 and pages.committed_bytes(live=False) == held  # idle, kept
    assert pages.background_commits > 0  # decode crossed pages committed ahead of it
    sync_before = pages.sync_commits
    second = Request("b", prompt(2, 30), greedy(60))
    engine.add_request(second)
    _decode_until(engine)
    assert pages.sync_commits == sync_before  # all its pages were already there
    assert pages.committed_bytes() == held
    pages.trim()
    assert pages.committed_bytes() == 0 and runtime.kv_cache.rss_bytes() == 0


def test_prefix_cache_is_off_and_the_slot_budget_admits_by_slots() -> None:
    """No device prefix cache with this layout; with two slots a third request waits."""
    from chatstore.engine.vattention import create_virtual_kv as make

    runtime = tiny_runtime(layout="vattention")
    spec = runtime.model.spec
    kv, pool = make(spec, 2, 64 * bytes_per_block(spec, 4, torch.float32), 4, torch.float32)
    runtime.kv_cache, runtime.pool = kv, pool
    runtime.runner = ModelRunner(runtime.model.weights, spec, kv)
    engine = LLMEngine(runtime, EngineConfig())
    system = prompt(7, 16)
    for name in "abc":
        engine.add_request(Request(name, [*system, 40], greedy(3), tenant="t"))
    engine.step()
    assert len(engine.scheduler.running) == 2 and engine.scheduler.num_waiting == 1
    _decode_until(engine)
    stats = engine.stats()
    assert stats.prefix_hits == 0 and stats.cached_blocks == 0
    assert_pool_clean(engine)


def test_huge_pages_commit_two_megabytes_a_buffer() -> None:
    """page_size 2 MB: a slot's 37 tokens commit one 2 MB page in each layer K/V buffer, 4 KB
    pages two (37 * 128 bytes); MADV_HUGEPAGE lets the kernel back them with huge pages where
    THP allows (printed); the logits are the same bits."""
    model = tiny_hf_model("llama", seed=2)
    spec = ModelSpec.from_hf_config(model.config)
    ids = list(range(3, 40))
    logits = {}
    for page in (BASE_PAGE, 2 << 20):
        kv, pool = create_virtual_kv(spec, 2, 1 << 20, 4, torch.float32, page_size=page)
        runner = ModelRunner(model, spec, kv)
        table = pool.allocate(10)
        logits[page] = runner.forward(ForwardBatch.build([SequenceChunk(ids, 0, table)], 4))
        buffers = 2 * spec.num_layers
        pages = -(-len(ids) * kv.token_bytes // page)
        assert kv.rss_bytes() == kv.nbytes == buffers * pages * page
        print(f"page {page}: AnonHugePages {kv.region.huge_page_bytes()} bytes")
        pool.free(table)
        kv.pages.trim()
        assert kv.rss_bytes() == 0
        kv.close()
    assert torch.equal(logits[BASE_PAGE], logits[2 << 20])
