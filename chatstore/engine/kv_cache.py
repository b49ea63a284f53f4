"""The device KV pool: one preallocated tensor of fixed-size blocks for every layer.

    kv: [L, 2, N, B, Hkv, D]    L layers, K/V, N blocks, B slots a block

One layer's K (or V) of one block is contiguous, so the store can read or write a session's
blocks for one layer as a few contiguous slices (layer-wise preload and save).
"""

from __future__ import annotations

import torch

from chatstore.engine.host_memory import zeros_on_demand
from chatstore.model.spec import ModelSpec


def bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * elem


def blocks_for_budget(
    spec: ModelSpec, block_size: int, dtype: torch.dtype, budget_bytes: int
) -> int:
    n = budget_bytes // bytes_per_block(spec, block_size, dtype)
    if n <= 0:
        raise ValueError(
            f"KV budget of {budget_bytes} bytes holds no block of "
            f"{bytes_per_block(spec, block_size, dtype)} bytes"
        )
    return int(n)


class PagedKVCache:
    def __init__(
        self,
        spec: ModelSpec,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (spec.num_layers, 2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        if self.device.type == "cpu":
            self.kv = zeros_on_demand(shape, dtype)  # pages resident as blocks are used
        else:
            self.kv = torch.zeros(shape, dtype=dtype, device=self.device)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def k(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 0]  # [N, B, Hkv, D]

    def v(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 1]

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store k, v [T, Hkv, D] at flat slots `slot_mapping` [T] (block * B + offset)."""
        flat_shape = (self.num_blocks * self.block_size, self.spec.num_kv_heads, self.spec.head_dim)
        self.kv[layer, 0].view(flat_shape).index_copy_(0, slot_mapping, k.to(self.dtype))
        self.kv[layer, 1].view(flat_shape).index_copy_(0, slot_mapping, v.to(self.dtype))

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: duplicate one block across all layers."""
        self.kv[:, :, dst].copy_(self.kv[:, :, src])
