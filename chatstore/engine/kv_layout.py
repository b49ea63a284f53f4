"""How the device KV pool is laid out, and what that decides: block tables and attention.

    KVLayout            one per layout, chosen once when the runner is built (`layouts.py`)
      block_manager()   the block tables the scheduler reserves through
      step_attention()  per forward: the step's plan, then the attention call per layer

Two layouts: `PagedLayout` here (fixed-size blocks anywhere in the pool, the prefix cache, the
paged decode / prefill kernels) and `VAttentionLayout` (`vattention/layout.py`: each sequence's
KV contiguous in a slot, stock SDPA over it, no prefix cache).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from chatstore.engine.block_manager import BlockManager
from chatstore.engine.block_pool import BlockIdPool
from chatstore.engine.forward_batch import ForwardBatch
from chatstore.engine.kv_cache import PagedKVCache
from chatstore.kernels.paged_attention import attend, paged_attention_reference
from chatstore.kernels.paged_decode import paged_decode
from chatstore.kernels.paged_prefill import paged_prefill


@dataclass(frozen=True)
class AttentionKernels:
    """What the runner settled on once: which attention paths it may take."""

    fast: bool  # attention = "auto": native kernels where they apply; False: the reference path
    native_prefill: bool  # the native paged-prefill kernel runs for this dtype, device, head dim
    scale: float  # head_dim ** -0.5
    groups: int  # query heads per KV head (GQA)


class StepAttention(ABC):
    """One forward's attention: planned once for the batch, called once per layer."""

    # Whether attention reads the step's K, V from the pool (so the runner need not keep them).
    in_place: bool

    @abstractmethod
    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> torch.Tensor:
        """q [T, Hq, D] (and the step's own k, v [T, Hkv, D] unless in place) -> [T, Hq, D]."""


class KVLayout(ABC):
    name: ClassVar[str]  # the `kv_layout` config value that selects it

    def __init__(self, kv_cache: PagedKVCache) -> None:
        self.kv_cache = kv_cache

    @abstractmethod
    def block_manager(self, pool: BlockIdPool, enable_prefix_cache: bool) -> BlockManager:
        """The block tables over `pool`, the block ids this layout's cache was built with."""

    @abstractmethod
    def step_attention(self, batch: ForwardBatch, kernels: AttentionKernels) -> StepAttention:
        """Plan the forward of `batch` (called before any layer runs)."""


class PagedLayout(KVLayout):
    name = "paged"

    def block_manager(self, pool: BlockIdPool, enable_prefix_cache: bool) -> BlockManager:
        return BlockManager(pool, self.kv_cache, enable_prefix_cache)

    def step_attention(self, batch: ForwardBatch, kernels: AttentionKernels) -> StepAttention:
        return PagedAttention(self.kv_cache, batch, kernels)


class PagedAttention(StepAttention):
    """Through the block tables: the decode kernel when every sequence has one new token, the
    paged-prefill kernel for everything else, gather-and-SDPA on the reference path."""

    def __init__(self, kv_cache: PagedKVCache, batch: ForwardBatch, kernels: AttentionKernels):
        self.kv_cache, self.batch, self.kernels = kv_cache, batch, kernels
        self.in_place = kernels.fast and (batch.decode_plan is not None or kernels.native_prefill)

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> torch.Tensor:
        batch, kernels = self.batch, self.kernels
        k_cache, v_cache = self.kv_cache.k(layer), self.kv_cache.v(layer)
        if kernels.fast:
            if batch.decode_plan is not None:
                return paged_decode(q, k_cache, v_cache, batch.decode_plan, kernels.scale)
            if kernels.native_prefill:
                return paged_prefill(q, k_cache, v_cache, batch.prefill_plan, kernels.scale)
            if (
                k is not None
                and v is not None
                and batch.num_seqs == 1
                and batch.query_lens[0] == batch.context_lens[0]
            ):
                # A fresh sequence: its whole KV is the k, v just computed; no gather needed.
                return attend(q, k, v, kernels.scale)
        return paged_attention_reference(
            q,
            k_cache,
            v_cache,
            batch.block_tables,
            batch.query_lens,
            batch.context_lens,
            kernels.scale,
        )
