"""Builds the pieces a forward needs from config: model, KV pool, block ids, runner."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from chatstore.config import Config
from chatstore.engine.block_pool import BlockPool
from chatstore.engine.kv_cache import PagedKVCache, blocks_for_budget
from chatstore.engine.runner import ModelRunner
from chatstore.engine.vattention import create_virtual_kv_for
from chatstore.engine.weight_plan import plan_projections, weights_fingerprint
from chatstore.model import LoadedModel, load_model

log = logging.getLogger(__name__)


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
    """The model (loaded here in the config's dtype, or `model` as given) with a KV pool and
    runner in the model's dtype: a model passed in decides the dtype when `dtype = "auto"`.
    The projections compute with `config.weights` (`weight_plan.py`: `auto` serves a GGUF's
    4-bit tensors as they are on a CPU when the dtype is auto and the model is loaded here)."""
    dtype_setting, model_given = config.dtype, model is not None
    if model is None:
        model = load_model(config.model, dtype=config.torch_dtype, device=config.device)
    else:
        config = runtime_config(config, model)
    dtype: torch.dtype = config.torch_dtype
    if config.kv_layout == "vattention":
        kv_cache, pool = create_virtual_kv_for(config, model.spec)
    else:
        num_blocks = blocks_for_budget(model.spec, config.block_size, dtype, config.kv_cache_bytes)
        kv_cache = PagedKVCache(model.spec, num_blocks, config.block_size, dtype, config.device)
        pool = BlockPool(num_blocks)
    projections = plan_projections(
        config.weights, dtype_setting, model, config.attention, config.device, model_given
    )
    runner = ModelRunner(model.hf_model, model.spec, kv_cache, config.attention, projections)
    if projections is not None:  # stored KV of these weights is not dense weights' KV
        model = replace(model, fingerprint=weights_fingerprint(model.fingerprint, projections.fmt))
    dense = f"weights = dense ({str(dtype).removeprefix('torch.')}, weights = {config.weights})"
    log.info("%s", dense if projections is None else projections.describe())
    return Runtime(model, kv_cache, pool, runner)


def runtime_config(config: Config, model: LoadedModel) -> Config:
    """`config` with its dtype taken from a model loaded elsewhere; says so when that differs
    from what `dtype = "auto"` picks on this machine."""
    matched = config.for_model_dtype(model.dtype)
    if matched is not config:
        log.info(
            "dtype = auto: running in %s, the dtype the model was loaded in (this CPU's auto "
            "choice is %s)",
            matched.dtype,
            config.resolved_dtype,
        )
    return matched
