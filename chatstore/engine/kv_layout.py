"""How the device KV pool is laid out, and what that decides: block tables and attention.

    KVLayout            one per layout, chosen once when the runner is built (`layouts.py`)
      block_manager()   the block tables the scheduler reserves through
      step_attention()  per forward: the step's plan, then the attention call per layer

Two layouts: `PagedLayout` here (fixed-size blocks anywhere in the pool, the prefix cache, the
paged decode / prefill kernels) and `VAttentionLayout` (`vattention/layout.py`: each sequence's
KV contiguous in a slot, stock SDPA over it, no prefix cache). On CUDA, with Triton installed, the
paged layout's attention is Triton's unified kernel (`chatstore.kernels.triton`): one launch per
layer for decode, prefill and mixed batches alike; Triton is imported only then.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
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
from chatstore.kernels.triton import available as triton_available


@dataclass(frozen=True)
class AttentionKernels:
    """What the runner settled on once: which attention paths it may take."""

    fast: bool  # attention = "auto": native kernels where they apply; False: the reference path
    native_prefill: bool  # the native paged-prefill kernel runs for this dtype, device, head dim
    scale: float  # head_dim ** -0.5
    groups: int  # query heads per KV head (GQA)
    # Triton's unified attention: None = where the pool is on CUDA and Triton is installed;
    # True = on any device (tests run it in Triton's CPU interpreter); False = never.
    triton: bool | None = None

    def use_triton(self, device: torch.device) -> bool:
        if not self.fast or self.triton is False:
            return False
        return self.triton is True or (device.type == "cuda" and triton_available())


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
    """Through the block tables: Triton's unified kernel for every batch where it applies (CUDA);
    else the decode kernel when every sequence has one new token, the paged-prefill kernel for
    everything else, gather-and-SDPA on the reference path."""

    def __init__(self, kv_cache: PagedKVCache, batch: ForwardBatch, kernels: AttentionKernels):
        self.kv_cache, self.batch, self.kernels = kv_cache, batch, kernels
        self.triton: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None
        self.triton = None
        if kernels.use_triton(kv_cache.device):
            self.triton = _triton_attention(batch, kernels.scale)
        self.in_place = self.triton is not None or (
            kernels.fast and (batch.decode_plan is not None or kernels.native_prefill)
        )

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> torch.Tensor:
        batch, kernels = self.batch, self.kernels
        k_cache, v_cache = self.kv_cache.k(layer), self.kv_cache.v(layer)
        if self.triton is not None:
            return self.triton(q, k_cache, v_cache)
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


def _triton_attention(
    batch: ForwardBatch, scale: float
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The step's Triton attention, its sequence layout put on the device once for all layers
    (or taken as it is from the batch: a decode graph's static buffers)."""
    from chatstore.kernels.triton.unified_attention import (
        AttentionMeta,
        make_attention_meta,
        unified_attention,
    )

    if batch.device_layout is not None:
        meta = AttentionMeta(*batch.device_layout)
    else:
        meta = make_attention_meta(batch.block_tables, batch.query_lens, batch.context_lens)
    return lambda q, k_cache, v_cache: unified_attention(q, k_cache, v_cache, meta, scale)
