"""Physical KV block ids: a free list and reference counts (vLLM §4.2-4.3).

The pool owns ids only; the tensors live in `PagedKVCache`. A block is free when its ref count is
0. The free list is an insertion-ordered dict (allocate from the front, free to the back, O(1)
removal from the middle when the prefix cache revives a cached free block). Sharing (n>1
samples, a common system prompt) increments the count; the last `free` returns the block to the
free list. Every method checks before it changes anything, so a failed call leaves
no partial state.
"""

from __future__ import annotations

from typing import Protocol


class BlockIdPool(Protocol):
    """Block ids and their reference counts, what a block manager reserves through: this
    `BlockPool`, or the vAttention layout's `SlotBlockPool` (the same vocabulary over slots)."""

    num_blocks: int

    @property
    def num_free(self) -> int: ...
    @property
    def num_used(self) -> int: ...
    def ref_count(self, block_id: int) -> int: ...
    def can_allocate(self, n: int) -> bool: ...
    def allocate(self, n: int) -> list[int]: ...
    def take(self, block_ids: list[int]) -> None: ...
    def share(self, block_ids: list[int]) -> None: ...
    def free(self, block_ids: list[int]) -> None: ...
    def check_integrity(self) -> None: ...


class BlockPoolExhausted(RuntimeError):
    """Not enough free KV blocks for the request."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise BlockPoolExhausted(
                f"KV block pool exhausted: {n} blocks requested, {len(self._free)} free "
                f"of {self.num_blocks}"
            )
        blocks = []
        for _ in range(n):
            b = next(iter(self._free))
            del self._free[b]
            self._ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def take(self, block_ids: list[int]) -> None:
        """One more reference to each block, free or not (a free one leaves the free list).

        The prefix cache uses this to revive a cached block whose owner has finished.
        """
        for b in block_ids:
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"block id {b} out of range [0, {self.num_blocks})")
        for b in block_ids:
            if self._ref_counts[b] == 0:
                del self._free[b]
            self._ref_counts[b] += 1

    def share(self, block_ids: list[int]) -> None:
        """Add one reference to each (already allocated) block."""
        for b in block_ids:
            self._check_allocated(b)
        for b in block_ids:
            self._ref_counts[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks reaching 0 return to the free list.

        Freed in reverse so a sequence's tail blocks are reused first, as in vLLM.
        """
        counts: dict[int, int] = {}
        for b in block_ids:
            counts[b] = counts.get(b, 0) + 1
        for b, n in counts.items():
            self._check_allocated(b)
            if self._ref_counts[b] < n:
                raise ValueError(f"block {b} freed {n} times but has {self._ref_counts[b]} refs")
        for b in reversed(block_ids):
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free[b] = None

    def check_integrity(self) -> None:
        """Free list and ref counts agree: every block is either free (0 refs) or referenced."""
        free = self._free
        for b, rc in enumerate(self._ref_counts):
            assert rc >= 0, f"block {b} has negative ref count"
            assert (rc == 0) == (b in free), f"block {b}: ref count {rc}, free={b in free}"

    def _check_allocated(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {self.num_blocks})")
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is not allocated")
