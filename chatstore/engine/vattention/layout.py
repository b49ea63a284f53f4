"""The vAttention layout: a slot of contiguous KV per running sequence (`kv_cache.py`), block
tables that are runs of a slot's blocks (`block_manager.py`), stock SDPA over the slots
(`attention.py`). The device prefix cache is off: sharing a block would break a slot's
contiguity (the store still restores a session's history)."""

from __future__ import annotations

import logging

import torch

from chatstore.engine.block_manager import BlockManager
from chatstore.engine.block_pool import BlockIdPool
from chatstore.engine.forward_batch import ForwardBatch
from chatstore.engine.kv_layout import AttentionKernels, KVLayout, PagedAttention, StepAttention
from chatstore.engine.vattention.attention import SlotPlan, make_slot_plan, slot_attention
from chatstore.engine.vattention.block_manager import SlotBlockManager
from chatstore.engine.vattention.kv_cache import VirtualKVCache
from chatstore.engine.vattention.slot_pool import SlotBlockPool

log = logging.getLogger(__name__)


class VAttentionLayout(KVLayout):
    name = "vattention"

    def __init__(self, kv_cache: VirtualKVCache) -> None:
        super().__init__(kv_cache)
        self.kv_cache: VirtualKVCache = kv_cache

    def block_manager(self, pool: BlockIdPool, enable_prefix_cache: bool) -> BlockManager:
        if not isinstance(pool, SlotBlockPool):
            raise TypeError(f"the vattention layout hands out slots: a SlotBlockPool, not {pool!r}")
        if enable_prefix_cache:
            log.info("kv_layout vattention: the device prefix cache is off (slots are private)")
        return SlotBlockManager(pool, self.kv_cache)

    def step_attention(self, batch: ForwardBatch, kernels: AttentionKernels) -> StepAttention:
        """The step's pages made resident first, on either path; then SDPA over the slots on the
        fast path, while the reference path reads the same blocks through the block table."""
        plan = make_slot_plan(batch, self.kv_cache, kernels.groups)
        self.kv_cache.prepare_step(plan.slots, batch.context_lens)
        if not kernels.fast:
            return PagedAttention(self.kv_cache, batch, kernels)
        return SlotAttention(self.kv_cache, plan, kernels.scale)


class SlotAttention(StepAttention):
    in_place = True  # SDPA reads the slots, where the step's K, V were just written

    def __init__(self, kv_cache: VirtualKVCache, plan: SlotPlan, scale: float) -> None:
        self.kv_cache, self.plan, self.scale = kv_cache, plan, scale

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> torch.Tensor:
        return slot_attention(q, self.kv_cache, layer, self.plan, self.scale)
