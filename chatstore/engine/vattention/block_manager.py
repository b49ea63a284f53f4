"""Block tables for the vAttention layout: one slot per running sequence, blocks in slot order.

A sequence's block table is always a run of its slot's blocks, [s*M, s*M + k), so its KV is
contiguous. Differences from the paged `BlockManager`:

- No device prefix cache: sharing a cached block would break a slot's contiguity (page-granular
  sharing through shared memfd pages is not implemented). The store still restores a session's
  history into the slot through the connector.
- n > 1: a forked sample first shares its parent's blocks (by reference, as with paging); the
  first `reserve` for it takes a slot of its own and copies the computed blocks there, before
  it writes anything. If no slot or budget is free, the scheduler preempts as usual.
"""

from __future__ import annotations

from chatstore.engine.block_manager import BlockManager
from chatstore.engine.sequence import Sequence
from chatstore.engine.vattention.kv_cache import VirtualKVCache
from chatstore.engine.vattention.slot_pool import SlotBlockPool


class SlotBlockManager(BlockManager):
    def __init__(self, pool: SlotBlockPool, kv_cache: VirtualKVCache) -> None:
        super().__init__(pool, kv_cache, enable_caching=False)
        self.pool: SlotBlockPool = pool
        self.kv_cache: VirtualKVCache = kv_cache
        self._owners: set[int] = set()  # seq_ids whose block table is their own slot's

    def blocks_needed(self, seq: Sequence, num_tokens: int, hit: list[int] | None = None) -> int:
        if seq.seq_id in self._owners:
            return max(0, self._num_blocks(num_tokens) - len(seq.block_table))
        return self._num_blocks(num_tokens)  # a fresh slot (shared blocks are copied over)

    def can_reserve(self, seq: Sequence, num_tokens: int, hit: list[int] | None = None) -> bool:
        if seq.seq_id not in self._owners:
            return self.pool.can_allocate(self._num_blocks(num_tokens))
        return self._num_blocks(num_tokens) <= self.pool.blocks_per_slot and (
            self.blocks_needed(seq, num_tokens) <= self.pool.num_free
        )

    def reserve(self, seq: Sequence, num_tokens: int, hit: list[int] | None = None) -> None:
        if not self.can_reserve(seq, num_tokens):
            raise RuntimeError("reserve called without a free slot or enough budget")
        if seq.seq_id not in self._owners:
            self._take_slot(seq, num_tokens)
            return
        missing = self._num_blocks(num_tokens) - len(seq.block_table)
        if missing > 0:
            slot = self.pool.slot_of(seq.block_table[0])
            seq.block_table.extend(self.pool.extend(slot, missing))

    def free(self, seq: Sequence) -> None:
        super().free(seq)
        self._owners.discard(seq.seq_id)

    def _take_slot(self, seq: Sequence, num_tokens: int) -> None:
        blocks = self.pool.allocate(self._num_blocks(num_tokens))
        self._owners.add(seq.seq_id)
        shared = seq.block_table
        if shared:  # a forked sample leaving its parent's slot: copy what is computed
            computed = self._num_blocks(seq.num_computed)
            self.kv_cache.copy_blocks(shared[:computed], blocks[:computed])
            self.pool.free(shared)
        seq.block_table = blocks
