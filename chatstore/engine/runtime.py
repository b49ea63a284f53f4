"""Builds the pieces a forward needs from config: model, KV pool, block ids, runner."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from chatstore.config import Config
from chatstore.engine.block_pool import BlockIdPool, BlockPool
from chatstore.engine.cpu_paths import cpu_path_warnings, describe_cpu_paths
from chatstore.engine.kv_cache import PagedKVCache, blocks_for_budget
from chatstore.engine.kv_layout import KVLayout, PagedLayout
from chatstore.engine.runner import ModelRunner
from chatstore.engine.vattention import create_virtual_kv_for
from chatstore.engine.vattention.layout import VAttentionLayout
from chatstore.engine.weight_plan import Projections, plan_projections, weights_fingerprint
from chatstore.model import LoadedModel, load_model
from chatstore.model.loader import load_tokenizer
from chatstore.model.spec import ModelSpec

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    model: LoadedModel
    kv_cache: PagedKVCache  # or its vAttention subclass, VirtualKVCache
    pool: BlockIdPool  # a BlockPool, or with a VirtualKVCache its SlotBlockPool
    runner: ModelRunner

    @property
    def block_size(self) -> int:
        return self.kv_cache.block_size

    @property
    def layout(self) -> KVLayout:
        """The cache's layout, as the runner chose it once: block tables and attention."""
        return self.runner.layout


def paged_kv_for(config: Config, spec: ModelSpec) -> tuple[PagedKVCache, BlockPool]:
    """The paged pool: as many blocks as `kv_cache_bytes` holds, anywhere in one tensor."""
    dtype = config.torch_dtype
    num_blocks = blocks_for_budget(spec, config.block_size, dtype, config.kv_cache_bytes)
    cache = PagedKVCache(spec, num_blocks, config.block_size, dtype, config.device)
    return cache, BlockPool(num_blocks)


# The `kv_layout` setting: the cache and block ids each layout is built on.
KV_POOLS: dict[str, Callable[[Config, ModelSpec], tuple[PagedKVCache, BlockIdPool]]] = {
    PagedLayout.name: paged_kv_for,
    VAttentionLayout.name: create_virtual_kv_for,
}


def create_runtime(config: Config, model: LoadedModel | None = None) -> Runtime:
    """The model (loaded here in the config's dtype, or `model` as given) with a KV pool and
    runner in the model's dtype: a model passed in decides the dtype when `dtype = "auto"`.
    The projections compute with `config.weights` (`weight_plan.py`: `auto` serves a GGUF's
    4-bit tensors as they are on a CPU when the dtype is auto and the model is loaded here)."""
    if model is not None:
        return _runtime_over(runtime_config(config, model), model, config.dtype, True)
    model = load_model(config.model, config.torch_dtype, config.device, tokenizer=False)
    # The tokenizer (importing transformers: ~1.3 s) loads while the weights are packed: that
    # work is in C (ctypes lets go of the GIL) and torch, so the two overlap.
    with ThreadPoolExecutor(1, thread_name_prefix="chatstore-tokenizer") as pool:
        tokenizer = pool.submit(load_tokenizer, model.path)
        runtime = _runtime_over(config, model, config.dtype, False)
        runtime.model = replace(runtime.model, tokenizer=tokenizer.result())
    return runtime


def _runtime_over(
    config: Config, model: LoadedModel, dtype_setting: str, model_given: bool
) -> Runtime:
    dtype = config.torch_dtype
    kv_cache, pool = KV_POOLS[config.kv_layout](config, model.spec)
    projections = plan_projections(
        config.weights,
        dtype_setting,
        model,
        config.attention,
        config.device,
        model_given,
        config.prefill_weights,
    )
    runner = ModelRunner(model.weights, model.spec, kv_cache, config.attention, projections)
    if projections is not None:  # stored KV of these weights is not dense weights' KV
        model = replace(
            model,
            fingerprint=weights_fingerprint(
                model.fingerprint, projections.fmt, prefill_of(projections)
            ),
        )
    dense = f"weights = dense ({str(dtype).removeprefix('torch.')}, weights = {config.weights})"
    log.info("%s", dense if projections is None else projections.describe())
    if config.device == "cpu":
        log.info("%s", describe_cpu_paths(dtype))
        for warning in cpu_path_warnings(dtype):
            log.warning("%s", warning)
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


def prefill_of(projections: Projections) -> str:
    """What a prompt's quantized projections compute on, for the KV's fingerprint: 16-bit copies
    (""), the weight expanded to 16 bits ("expanded"), or int8 dot products ("int8")."""
    scratch = projections.scratch
    if scratch is None:
        return ""
    return "int8" if scratch.int8 else "expanded"
