"""The graph-ready decode path (static_buffers.py, cuda_graphs.py) on the CPU, without capture:
buckets, the buffers' exact contents, and the path pinned to the eager forward (bitwise where
the batch is a bucket, so the arithmetic is the same; within fp32 rounding where padding rows
change the matrix shapes), the KV sink included, and an engine serving with it."""

from __future__ import annotations

import pytest
import torch

from chatstore.engine.cuda_graphs import DecodeGraphs
from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.forward_batch import ForwardBatch, SequenceChunk
from chatstore.engine.llm_engine import LLMEngine
from chatstore.engine.request import Request
from chatstore.engine.runner import ModelRunner
from chatstore.engine.static_buffers import bucket_for, decode_buckets
from tests.support.engine import greedy, prompt, run_all, tiny_runtime, tokens_of

pytestmark = pytest.mark.usefixtures("single_thread")

BLOCK = 4
SCRATCH = 63


def test_buckets() -> None:
    assert decode_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert decode_buckets(30) == [1, 2, 4, 8, 16, 24, 32]
    assert decode_buckets(3) == [1, 2, 4]
    assert decode_buckets(1) == [1]
    buckets = decode_buckets(32)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 9, 17, 32, 33)] == [
        1, 2, 4, 8, 16, 24, 32, None,
    ]  # fmt: skip


def graphs_over(runner: ModelRunner, saves_kv: bool = False) -> DecodeGraphs:
    return DecodeGraphs(runner, 8, 6, SCRATCH, saves_kv, capture=False)


def test_buffers_hold_the_rows_then_padding_at_the_scratch_block() -> None:
    graphs = graphs_over(tiny_runtime(block_size=BLOCK).runner)
    chunks = [
        SequenceChunk([17], 5, [3, 9]),  # position 5: block 9, offset 1
        SequenceChunk([18], 0, [4]),
        SequenceChunk([19], 8, [1, 2, 7]),
    ]
    b = graphs.buffers
    assert b.fits(chunks) and not b.fits([SequenceChunk([1, 2], 0, [3])])
    assert not b.fits([SequenceChunk([1], 24, [0] * 7)])  # a table wider than 6 blocks
    b.fill(chunks, bucket_for(3, graphs.buckets))
    assert b.input_ids[:4].tolist() == [17, 18, 19, 0]
    assert b.positions[:4].tolist() == [5, 0, 8, 0]
    assert b.slot_mapping[:4].tolist() == [9 * 4 + 1, 4 * 4, 7 * 4, SCRATCH * 4]
    assert b.seq_lens[:4].tolist() == [6, 1, 9, 1]
    s = SCRATCH
    assert b.block_tables[:4].tolist() == [
        [3, 9, s, s, s, s], [4, s, s, s, s, s], [1, 2, 7, s, s, s], [s] * 6,
    ]  # fmt: skip


def eager(runner: ModelRunner, chunks: list[SequenceChunk], sink=None) -> torch.Tensor:
    return runner.forward(ForwardBatch.build(chunks, BLOCK), kv_sink=sink)


def prefill_two(runner: ModelRunner) -> list[SequenceChunk]:
    """Two prompts in the pool, then each one's first decode chunk."""
    a, b = prompt(1, 9), prompt(2, 6)
    eager(runner, [SequenceChunk(a, 0, [3, 9, 12]), SequenceChunk(b, 0, [4, 5])])
    return [SequenceChunk([40], 9, [3, 9, 12]), SequenceChunk([41], 6, [4, 5])]


class Recorder:
    """A KV sink keeping copies of what it is given, as the store's saver does."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, torch.Tensor, torch.Tensor, list[int], list[str] | None]] = []

    def __call__(self, layer: int, k, v, batch: ForwardBatch) -> None:
        self.rows.append((layer, k.clone(), v.clone(), batch.positions.tolist(), batch.request_ids))


def test_a_bucket_sized_step_is_bitwise_the_eager_forward_sink_included() -> None:
    runner = tiny_runtime(block_size=BLOCK).runner
    chunks = prefill_two(runner)
    pool_before = runner.kv_cache.kv.clone()
    want_sink, got_sink = Recorder(), Recorder()
    want = eager(runner, chunks, want_sink)
    pool_eager = runner.kv_cache.kv.clone()
    runner.kv_cache.kv.copy_(pool_before)
    graphs = graphs_over(runner, saves_kv=True)
    got = graphs.run(chunks, ["a", "b"], got_sink)
    assert torch.equal(got, want)
    assert torch.equal(runner.kv_cache.kv, pool_eager)
    assert len(got_sink.rows) == len(want_sink.rows) == runner.spec.num_layers
    for (li, k, v, pos, _), (lj, k2, v2, pos2, ids) in zip(
        want_sink.rows, got_sink.rows, strict=True
    ):
        assert (li, pos) == (lj, pos2) and torch.equal(k, k2) and torch.equal(v, v2)
        assert ids == ["a", "b"]


def test_a_padded_step_matches_eager_and_writes_no_other_block() -> None:
    # Qwen2: random q/k/v biases, so even the padding token (a zero embedding) writes K, V
    # that are not zero, and a stray write shows.
    runner = tiny_runtime(block_size=BLOCK, arch="qwen2").runner
    chunks = prefill_two(runner)
    chunks.append(SequenceChunk([42], 0, [20]))  # a third sequence: bucket 4, one padding row
    pool_before = runner.kv_cache.kv.clone()
    want = eager(runner, chunks)
    pool_eager = runner.kv_cache.kv.clone()
    runner.kv_cache.kv.copy_(pool_before)
    graphs = graphs_over(runner)
    got = graphs.run(chunks, None, None)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-5
    others = [i for i in range(runner.kv_cache.num_blocks) if i != SCRATCH]
    pool = runner.kv_cache.kv[:, :, others]
    assert (pool - pool_eager[:, :, others]).abs().max().item() <= 1e-5
    untouched = [i for i in others if i not in (3, 9, 12, 4, 5, 20)]
    assert torch.equal(pool_before[:, :, untouched], runner.kv_cache.kv[:, :, untouched])


def serve(graphs: bool | None) -> tuple[dict[str, list[int]], LLMEngine]:
    runtime = tiny_runtime(num_blocks=64, block_size=BLOCK)
    engine = LLMEngine(runtime, EngineConfig(max_running=6, cuda_graphs=graphs))
    for i in range(5):
        engine.add_request(Request(f"r{i}", prompt(10 + i, 3 + 4 * i), greedy(6 + i)))
    outs = run_all(engine)
    return {rid: tokens_of(o) for rid, o in outs.items()}, engine


def test_an_engine_decoding_through_the_graph_path_gives_the_eager_tokens() -> None:
    want, plain = serve(None)  # the CPU default: no graphs
    assert plain._forward.graphs is None
    got, engine = serve(True)
    assert got == want
    graphs = engine._forward.graphs
    assert graphs is not None and graphs.replays > 0 and graphs.captured == []
    pool = engine.runtime.pool
    assert pool.num_free == pool.num_blocks - 1  # the scratch block, held for good


def test_the_config_switch() -> None:
    from chatstore.config import Config

    assert EngineConfig.from_config(Config()).cuda_graphs is None  # auto: CUDA only
    assert EngineConfig.from_config(Config(cuda_graphs="on")).cuda_graphs is True
    assert EngineConfig.from_config(Config(cuda_graphs="off")).cuda_graphs is False
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig.from_config(Config(cuda_graphs="yes"))
