"""Builds the pieces a forward needs from config: model, KV pool, block ids, runner."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chatstore.config import Config
from chatstore.engine.block_pool import BlockPool
from chatstore.engine.kv_cache import PagedKVCache, blocks_for_budget
from chatstore.engine.runner import ModelRunner
from chatstore.engine.vattention import create_virtual_kv_for
from chatstore.model import LoadedModel, load_model


@dataclass
class Runtime:
    model: LoadedModel
    kv_cache: PagedKVCache  # or its vAttention subclass, VirtualKVCache
    pool: BlockPool  # or, with it, a SlotBlockPool
    runner: ModelRunner

    @property
    def block_size(self) -> int:
        return self.kv_cache.block_size


def create_runtime(config: Config, model: LoadedModel | None = None) -> Runtime:
    dtype: torch.dtype = config.torch_dtype
    model = model or load_model(config.model, dtype=dtype, device=config.device)
    if config.kv_layout == "vattention":
        kv_cache, pool = create_virtual_kv_for(config, model.spec)
    else:
        num_blocks = blocks_for_budget(model.spec, config.block_size, dtype, config.kv_cache_bytes)
        kv_cache = PagedKVCache(model.spec, num_blocks, config.block_size, dtype, config.device)
        pool = BlockPool(num_blocks)
    runner = ModelRunner(model.hf_model, model.spec, kv_cache, config.attention)
    return Runtime(model, kv_cache, pool, runner)
