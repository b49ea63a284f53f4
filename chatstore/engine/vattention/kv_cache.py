"""The vAttention KV pool: the paged pool's layout over reserved, on-demand-committed memory.

    kv: [L, 2, N, B, Hkv, D] with N = S * M    S slots, M blocks a slot

The tensor is a zero-copy view of one `VirtualRegion`; nothing is resident until committed.
Slot s owns the consecutive block ids [s*M, (s+1)*M), so a running request's K of layer l is the
contiguous tensor

    kv[l, 0, s*M : (s+1)*M].view(M*B, Hkv, D)        ==  K_l[s]  of  [S, M*B, Hkv, D]

and the active slots lo..hi-1 are one strided view [hi-lo, M*B, Hkv, D]: stock SDPA reads them
without a block table. Block ids keep their meaning for everyone else (slot_mapping writes, the
store connector's per-layer load and save, swap, the reference attention).

M is ceil(max_context / B) rounded up so that a slot's bytes in one buffer are a whole number of
pages: every slot starts page-aligned and commits and releases its own pages only (the extra
blocks past max_context cost address space, never memory).
"""

from __future__ import annotations

import math

import torch

from chatstore.engine.kv_cache import PagedKVCache
from chatstore.engine.vattention.committer import PageCommitter
from chatstore.engine.vattention.virtual_memory import BASE_PAGE, HUGE_PAGE, VirtualRegion
from chatstore.model.spec import ModelSpec


def blocks_per_slot(max_context: int, block_size: int, block_bytes: int, page_size: int) -> int:
    step = page_size // math.gcd(page_size, block_bytes)
    blocks = -(-max_context // block_size)
    return -(-blocks // step) * step


class VirtualKVCache(PagedKVCache):
    def __init__(
        self,
        spec: ModelSpec,
        num_slots: int,
        max_context: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        page_size: int = BASE_PAGE,
        watermark_bytes: int = 0,
    ) -> None:
        if block_size <= 0 or num_slots <= 0 or max_context <= 0:
            raise ValueError("block_size, num_slots and max_context must be positive")
        if torch.device(device).type != "cpu":
            raise NotImplementedError(
                "kv_layout = 'vattention' is implemented for the CPU only; the CUDA backend "
                "(cuMemAddressReserve / cuMemCreate / cuMemMap) is not written yet"
            )
        self.spec, self.block_size, self.dtype = spec, block_size, dtype
        self.device = torch.device(device)
        elem = torch.empty((), dtype=dtype).element_size()
        self.token_bytes = spec.num_kv_heads * spec.head_dim * elem
        block_bytes = block_size * self.token_bytes
        self.num_slots = num_slots
        self.blocks_per_slot = blocks_per_slot(max_context, block_size, block_bytes, page_size)
        self.slot_tokens = self.blocks_per_slot * block_size
        self.num_blocks = num_slots * self.blocks_per_slot
        shape = (spec.num_layers, 2, self.num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        buffer_bytes = self.num_blocks * block_bytes
        self.region = VirtualRegion(
            2 * spec.num_layers * buffer_bytes, page_size, huge=page_size >= HUGE_PAGE
        )
        self.kv = self.region.tensor(dtype)[: math.prod(shape)].view(shape)
        self.pages = PageCommitter(
            self.region,
            num_buffers=2 * spec.num_layers,
            buffer_stride=buffer_bytes,
            slot_bytes=self.blocks_per_slot * block_bytes,
            token_bytes=self.token_bytes,
            num_slots=num_slots,
            watermark_bytes=watermark_bytes,
        )

    @property
    def nbytes(self) -> int:
        """Memory held now (committed pages), not the reserved address space."""
        return self.pages.committed_bytes()

    def slot_of(self, block_id: int) -> int:
        return block_id // self.blocks_per_slot

    def slot_blocks(self, slot: int, start: int, n: int) -> list[int]:
        first = slot * self.blocks_per_slot + start
        return list(range(first, first + n))

    def slots_view(self, layer: int, which: int, lo: int, hi: int) -> torch.Tensor:
        """K (which=0) or V (1) of slots lo..hi-1 of one layer: [hi-lo, M*B, Hkv, D], no copy."""
        m = self.blocks_per_slot
        spec = self.spec
        return self.kv[layer, which, lo * m : hi * m].view(
            hi - lo, self.slot_tokens, spec.num_kv_heads, spec.head_dim
        )

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy runs of blocks across all layers (an n > 1 sample taking its own slot)."""
        if not src:
            return
        a, b, n = src[0], dst[0], len(src)
        assert src == list(range(a, a + n)) and dst == list(range(b, b + n)), "not slot runs"
        self.pages.ensure(self.slot_of(b), n * self.block_size)
        self.kv[:, :, b : b + n].copy_(self.kv[:, :, a : a + n])

    def prepare_step(self, slots: list[int], context_lens: list[int]) -> None:
        """Before a forward: its pages resident (synchronously, the rare miss counts as alloc
        wait); then the next step's, one more token each, committed in the background while
        this forward runs."""
        for slot, ctx in zip(slots, context_lens, strict=True):
            self.pages.ensure(slot, ctx)
        self.pages.prefetch([(s, ctx + 1) for s, ctx in zip(slots, context_lens, strict=True)])

    def rss_bytes(self) -> int:
        """Memory the reservation holds now, as the OS counts it (smaps Rss)."""
        return self.region.rss_bytes()

    def close(self) -> None:
        """Stop the committer thread. The mapping is not unmapped: tensors viewing it may
        outlive the cache, so it goes with the process (trim() first to give its pages back)."""
        self.pages.close()
