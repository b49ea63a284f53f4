"""vAttention: each running sequence's KV contiguous in a slot of reserved address space, with
physical pages committed on demand (Prabhu et al., seed 004). See `kv_cache.py` for the layout,
`committer.py` for commit/release/reuse, `attention.py` for the SDPA backend."""

from __future__ import annotations

import torch

from chatstore.config import Config
from chatstore.engine.kv_cache import bytes_per_block
from chatstore.engine.vattention.kv_cache import VirtualKVCache
from chatstore.engine.vattention.slot_pool import SlotBlockPool
from chatstore.engine.vattention.virtual_memory import BASE_PAGE
from chatstore.model.spec import ModelSpec

__all__ = ["SlotBlockPool", "VirtualKVCache", "create_virtual_kv", "create_virtual_kv_for"]


def create_virtual_kv(
    spec: ModelSpec,
    num_slots: int,
    budget_bytes: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    page_size: int = BASE_PAGE,
    watermark_bytes: int | None = None,
    max_context: int | None = None,
) -> tuple[VirtualKVCache, SlotBlockPool]:
    """A slot cache and its pool, wired so that a slot's pages follow its owner.

    `budget_bytes` bounds the KV held by live sequences (as `kv_cache_bytes` does for the paged
    pool); idle slots keep up to `watermark_bytes` more (default: a quarter of the budget)."""
    per_block = bytes_per_block(spec, block_size, dtype)
    budget_blocks = budget_bytes // per_block
    if budget_blocks <= 0:
        raise ValueError(f"KV budget of {budget_bytes} bytes holds no block of {per_block} bytes")
    if watermark_bytes is None:
        watermark_bytes = budget_bytes // 4
    cache = VirtualKVCache(
        spec,
        num_slots,
        max_context or spec.max_context,
        block_size,
        dtype,
        page_size=page_size,
        watermark_bytes=watermark_bytes,
    )
    pool = SlotBlockPool(num_slots, cache.blocks_per_slot, int(budget_blocks))
    pool.on_acquire = cache.pages.acquire
    pool.on_release = cache.pages.release
    return cache, pool


def create_virtual_kv_for(config: Config, spec: ModelSpec) -> tuple[VirtualKVCache, SlotBlockPool]:
    """From a `chatstore.config.Config`: one slot per running sequence (max_running)."""
    if torch.device(config.device).type != "cpu":
        raise NotImplementedError(
            "kv_layout = 'vattention' runs on the CPU only; the CUDA virtual memory backend "
            "(cuMemAddressReserve / cuMemCreate / cuMemMap) is not implemented"
        )
    watermark = config.kv_reclaim_watermark_bytes
    return create_virtual_kv(
        spec,
        num_slots=config.max_running,
        budget_bytes=config.kv_cache_bytes,
        block_size=config.block_size,
        dtype=config.torch_dtype,
        page_size=config.kv_page_size,
        watermark_bytes=None if watermark < 0 else watermark,
    )
