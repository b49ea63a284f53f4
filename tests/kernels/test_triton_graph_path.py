"""The decode graph path (cuda_graphs.py) on the Triton kernels, as CUDA runs it, here without
capture in Triton's interpreter: attention reads the static buffers' device layout (int64, a
fixed `max_seq_len`, so the launch shape, split-KV included, does not depend on the step)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from chatstore.engine.cuda_graphs import DecodeGraphs
from chatstore.engine.forward_batch import ForwardBatch, SequenceChunk
from chatstore.engine.kv_cache import PagedKVCache
from chatstore.engine.runner import ModelRunner
from chatstore.model.spec import ModelSpec
from tests.support.engine import prompt
from tests.support.tiny_models import tiny_hf_model

BLOCK = 16
TOL = 1e-5  # fp32: padding rows change the projections' shapes, split-KV the summation order


def eager(runner: ModelRunner, chunks: list[SequenceChunk]) -> torch.Tensor:
    return runner.forward(ForwardBatch.build(chunks, BLOCK))


def test_graph_path_on_triton_matches_eager() -> None:
    max_blocks = 32  # 512 keys: the static layout's launch splits KV (eager's does not)
    model = tiny_hf_model("qwen2", seed=7)
    spec = ModelSpec.from_hf_config(model.config)
    runner = ModelRunner(model, spec, PagedKVCache(spec, 40, BLOCK, torch.float32), triton=True)
    a, b, c = prompt(1, 20), prompt(2, 7), prompt(3, 33)
    tables = [[3, 9], [12], [1, 2, 30]]
    eager(runner, [SequenceChunk(p, 0, t) for p, t in zip((a, b, c), tables, strict=True)])
    step = [
        SequenceChunk([50 + i], len(p), t)
        for i, (p, t) in enumerate(zip((a, b, c), tables, strict=True))
    ]
    graphs = DecodeGraphs(runner, 4, max_blocks, 39, saves_kv=False, capture=False)
    batch = graphs.buffers.batch(4, step)
    assert batch.device_layout is not None and batch.device_layout.max_seq_len == max_blocks * 16
    pool = runner.kv_cache.kv.clone()
    want = eager(runner, step)
    runner.kv_cache.kv.copy_(pool)
    got = graphs.run(step, None, None)
    assert got.shape == want.shape == (3, 256)
    assert (got - want).abs().max().item() <= TOL
