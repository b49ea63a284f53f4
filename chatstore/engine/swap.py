"""Host swap space for preemption by swapping (vLLM §4.5): KV blocks copied out and back.

    device kv  [L, 2, N, B, Hkv, D]  --swap_out(blocks)-->  host kv [L, 2, Nh, B, Hkv, D]
                                     <--swap_in(blocks)---

Host blocks have their own `BlockPool`. The host tensor is pinned when the device is CUDA, so
the copies can run asynchronously; on CPU it is a second, separate pool of plain memory.
"""

from __future__ import annotations

import torch

from chatstore.engine.block_pool import BlockPool
from chatstore.engine.kv_cache import PagedKVCache, bytes_per_block


class HostSwapSpace:
    def __init__(self, kv_cache: PagedKVCache, swap_space_bytes: int) -> None:
        per_block = bytes_per_block(kv_cache.spec, kv_cache.block_size, kv_cache.dtype)
        self.num_blocks = swap_space_bytes // per_block
        self.device_cache = kv_cache
        self.pool = BlockPool(self.num_blocks) if self.num_blocks > 0 else None
        shape = list(kv_cache.kv.shape)
        shape[2] = max(self.num_blocks, 1)
        pin = kv_cache.device.type == "cuda"
        self.kv = torch.empty(shape, dtype=kv_cache.dtype, device="cpu", pin_memory=pin)
        self.swapped_out = self.swapped_in = 0  # blocks moved, for stats

    @property
    def num_free(self) -> int:
        return self.pool.num_free if self.pool is not None else 0

    def can_swap_out(self, num_blocks: int) -> bool:
        return self.pool is not None and self.pool.can_allocate(num_blocks)

    def swap_out(self, device_blocks: list[int]) -> list[int]:
        """Copy the device blocks to newly taken host blocks; returns the host block ids."""
        if self.pool is None or not self.pool.can_allocate(len(device_blocks)):
            raise RuntimeError("swap space exhausted")
        host_blocks = self.pool.allocate(len(device_blocks))
        src = torch.tensor(device_blocks, dtype=torch.long, device=self.device_cache.device)
        data = self.device_cache.kv.index_select(2, src).to("cpu")  # [L, 2, n, B, Hkv, D]
        self.kv.index_copy_(2, torch.tensor(host_blocks, dtype=torch.long), data)
        self.swapped_out += len(device_blocks)
        return host_blocks

    def swap_in(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        """Copy host blocks back into (already allocated) device blocks and free the host ones."""
        if len(host_blocks) != len(device_blocks):
            raise ValueError("swap_in needs one device block per host block")
        data = self.kv.index_select(2, torch.tensor(host_blocks, dtype=torch.long))
        dst = torch.tensor(device_blocks, dtype=torch.long, device=self.device_cache.device)
        self.device_cache.kv.index_copy_(2, dst, data.to(self.device_cache.device))
        self.free(host_blocks)
        self.swapped_in += len(host_blocks)

    def free(self, host_blocks: list[int]) -> None:
        if host_blocks and self.pool is not None:
            self.pool.free(host_blocks)
