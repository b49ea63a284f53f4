"""Helpers for the engine tests: a Runtime over a tiny random model, and run-to-completion loops."""

from __future__ import annotations

from pathlib import Path

import torch

from chatstore.engine.block_pool import BlockPool
from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.kv_cache import PagedKVCache, bytes_per_block
from chatstore.engine.llm_engine import LLMEngine
from chatstore.engine.request import Request, RequestOutput, SamplingParams
from chatstore.engine.runner import ModelRunner
from chatstore.engine.runtime import Runtime
from chatstore.engine.vattention import create_virtual_kv
from chatstore.model import LoadedModel
from chatstore.model.spec import ModelSpec
from chatstore.model.weights import as_weights
from tests.support.tiny_models import tiny_hf_model

_MODELS: dict[str, object] = {}


def tiny_runtime(
    num_blocks: int = 64,
    block_size: int = 4,
    arch: str = "llama",
    tokenizer=None,
    dtype: torch.dtype = torch.float32,
    layout: str = "paged",
) -> Runtime:
    """`layout` "vattention": a slot per sequence (32 slots, the default max_running) over a
    budget of `num_blocks` blocks."""
    if (arch, dtype) not in _MODELS:
        _MODELS[arch, dtype] = tiny_hf_model(arch).to(dtype)
    hf = _MODELS[arch, dtype]
    spec = ModelSpec.from_hf_config(hf.config)
    model = LoadedModel(as_weights(hf), tokenizer, spec, Path("."), dtype, f"tiny-{arch}-{dtype}")
    if layout == "vattention":
        budget = num_blocks * bytes_per_block(spec, block_size, dtype)
        vkv, slots = create_virtual_kv(spec, 32, budget, block_size, dtype)
        return Runtime(model, vkv, slots, ModelRunner(hf, spec, vkv))
    kv = PagedKVCache(spec, num_blocks, block_size, dtype, "cpu")
    return Runtime(model, kv, BlockPool(num_blocks), ModelRunner(hf, spec, kv))


def greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def prompt(seed: int, length: int, vocab: int = 256) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (length,), generator=g).tolist()


def run_all(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, list[RequestOutput]]:
    """Step until idle; all outputs by request id."""
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return outs
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    raise AssertionError("engine did not finish")


def tokens_of(outputs: list[RequestOutput], index: int = 0) -> list[int]:
    return [t for o in outputs for s in o.samples if s.index == index for t in s.token_ids]


def finish_of(outputs: list[RequestOutput], index: int = 0) -> str | None:
    reasons = [s.finish_reason for o in outputs for s in o.samples if s.index == index]
    return next((r for r in reasons if r is not None), None)


def run_alone(
    req: Request, arch: str = "llama", dtype: torch.dtype = torch.float32, layout: str = "paged"
) -> list[int]:
    """The request's greedy tokens when it is the only one in a fresh engine."""
    engine = LLMEngine(tiny_runtime(arch=arch, dtype=dtype, layout=layout), EngineConfig())
    engine.add_request(Request(req.request_id, list(req.prompt_token_ids), req.sampling))
    return tokens_of(run_all(engine)[req.request_id])


def assert_pool_clean(engine: LLMEngine) -> None:
    pool = engine.runtime.pool
    pool.check_integrity()
    assert pool.num_free == pool.num_blocks
    assert not engine.has_work()
