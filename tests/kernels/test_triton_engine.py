"""The engine on a runner that takes the Triton kernels (what CUDA gets by default).

With Triton's attention a step mixing decodes and prefill chunks runs as one forward
(`ModelRunner.mixed_batches_in_place`), where the CPU's reference path runs it as two; the
greedy tokens must be those of the CPU runner on its own kernels.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from chatstore.engine.block_pool import BlockPool
from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.forward_batch import ForwardBatch
from chatstore.engine.kv_cache import PagedKVCache
from chatstore.engine.llm_engine import LLMEngine
from chatstore.engine.request import Request
from chatstore.engine.runner import ModelRunner
from chatstore.engine.runtime import Runtime
from chatstore.model import LoadedModel
from chatstore.model.spec import ModelSpec
from tests.support.engine import greedy, prompt, run_all, tokens_of
from tests.support.tiny_models import tiny_hf_model

BLOCK = 16


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def engine(triton: bool) -> tuple[LLMEngine, list[ForwardBatch]]:
    """An engine over a tiny Llama, and the batches its runner's forwards saw."""
    hf = tiny_hf_model("llama", seed=3)
    spec = ModelSpec.from_hf_config(hf.config)
    kv = PagedKVCache(spec, 32, BLOCK, torch.float32)
    runner = ModelRunner(hf, spec, kv, triton=triton)
    seen: list[ForwardBatch] = []
    forward = runner.forward

    def recording_forward(batch: ForwardBatch, *args, **kwargs) -> torch.Tensor:
        seen.append(batch)
        return forward(batch, *args, **kwargs)

    runner.forward = recording_forward  # type: ignore[method-assign]
    model = LoadedModel(hf, None, spec, Path("."), torch.float32, "tiny-llama-triton")
    return LLMEngine(Runtime(model, kv, BlockPool(32), runner), EngineConfig()), seen


def run(triton: bool) -> tuple[dict[str, list[int]], list[ForwardBatch]]:
    eng, seen = engine(triton)
    eng.add_request(Request("a", prompt(1, 9), greedy(6)))
    first = eng.step()  # a's prompt
    eng.add_request(Request("b", prompt(2, 20), greedy(4)))  # joins while a decodes
    outs = run_all(eng)
    outs["a"] = first + outs["a"]
    return {rid: tokens_of(o) for rid, o in outs.items()}, seen


def test_mixed_steps_run_in_one_forward_with_the_cpu_runners_tokens() -> None:
    cpu_tokens, _ = run(triton=False)
    tokens, batches = run(triton=True)
    assert tokens == cpu_tokens and [len(tokens["a"]), len(tokens["b"])] == [6, 4]
    # a's decode beside b's whole prompt in one forward, then both decode together.
    assert [b.query_lens for b in batches[:3]] == [[9], [1, 20], [1, 1]]
