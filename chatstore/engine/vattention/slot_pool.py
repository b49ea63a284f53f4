"""Block ids over slots: which slots are free, reference counts, and the memory budget.

The same vocabulary as `BlockPool` (num_blocks, num_free, allocate, share, free, ref_count,
check_integrity), with one change of meaning: `allocate(n)` is a new sequence's first n blocks,
the leading blocks of a free slot, and `extend(slot, n)` grows that sequence in slot order.
A slot returns to the free list when the last reference to its blocks goes (an n > 1 sibling
still reading a finished parent's blocks keeps the slot taken until it has its own).

Free slots are handed out lowest index first, so the live slots stay compact for batched decode;
the committer reclaims idle pages from the highest slots first, so a low slot usually still has
its pages (deferred reclamation).

`num_blocks` is the memory budget in blocks, not the address space: admission and preemption see
the "free blocks" they see with the paged layout, plus one more limit, a free slot.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from chatstore.engine.block_pool import BlockPoolExhausted


class SlotBlockPool:
    def __init__(self, num_slots: int, blocks_per_slot: int, budget_blocks: int) -> None:
        if num_slots <= 0 or blocks_per_slot <= 0 or budget_blocks <= 0:
            raise ValueError("num_slots, blocks_per_slot and budget_blocks must be positive")
        self.num_slots = num_slots
        self.blocks_per_slot = blocks_per_slot
        self.num_blocks = budget_blocks
        self._refs: dict[int, int] = {}
        self._free_slots = list(range(num_slots))  # a heap: lowest index first
        self._used = [0] * num_slots  # leading blocks of each slot handed out
        self._held = [0] * num_slots  # blocks of each slot with a reference
        self.on_acquire: Callable[[int], None] | None = None  # the page committer's hooks
        self.on_release: Callable[[int], None] | None = None

    @property
    def num_free(self) -> int:
        return self.num_blocks - len(self._refs)

    @property
    def num_used(self) -> int:
        return len(self._refs)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def slot_of(self, block_id: int) -> int:
        return block_id // self.blocks_per_slot

    def ref_count(self, block_id: int) -> int:
        return self._refs.get(block_id, 0)

    def can_allocate(self, n: int) -> bool:
        return 0 < n <= min(self.num_free, self.blocks_per_slot) and bool(self._free_slots)

    def allocate(self, n: int) -> list[int]:
        """A free slot's first n blocks (n >= 1), for a new sequence."""
        if n <= 0:
            raise ValueError(f"a slot is taken with at least one block, not {n}")
        if not self._free_slots:
            raise BlockPoolExhausted(f"all {self.num_slots} KV slots are in use")
        self._check_room(0, n)
        slot = heapq.heappop(self._free_slots)
        self._used[slot] = 0
        if self.on_acquire is not None:
            self.on_acquire(slot)
        return self.extend(slot, n)

    def extend(self, slot: int, n: int) -> list[int]:
        """The slot's next n blocks, one reference each."""
        used = self._used[slot]
        self._check_room(used, n)
        first = slot * self.blocks_per_slot + used
        blocks = list(range(first, first + n))
        for b in blocks:
            self._refs[b] = 1
        self._used[slot] = used + n
        self._held[slot] += n
        return blocks

    def take(self, block_ids: list[int]) -> None:
        """One more reference to each block. `BlockPool.take` may also revive a free cached
        block; slots keep no prefix cache, so here there is none to revive: taking is sharing."""
        self.share(block_ids)

    def share(self, block_ids: list[int]) -> None:
        for b in block_ids:
            self._check_allocated(b)
        for b in block_ids:
            self._refs[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; a slot with none left becomes free."""
        counts: dict[int, int] = {}
        for b in block_ids:
            counts[b] = counts.get(b, 0) + 1
        for b, n in counts.items():
            self._check_allocated(b)
            if self._refs[b] < n:
                raise ValueError(f"block {b} freed {n} times but has {self._refs[b]} refs")
        for b in block_ids:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                del self._refs[b]
                slot = self.slot_of(b)
                self._held[slot] -= 1
                if self._held[slot] == 0:
                    heapq.heappush(self._free_slots, slot)
                    if self.on_release is not None:
                        self.on_release(slot)

    def check_integrity(self) -> None:
        held = [0] * self.num_slots
        for b, rc in self._refs.items():
            assert rc > 0, f"block {b} has ref count {rc}"
            held[self.slot_of(b)] += 1
        assert held == self._held, "per-slot held counts disagree with the ref counts"
        free = set(self._free_slots)
        assert len(free) == len(self._free_slots), "a slot is free twice"
        assert all(held[s] == 0 for s in free), "a free slot has referenced blocks"
        assert len(self._refs) <= self.num_blocks, "more blocks held than the budget"

    def _check_room(self, used: int, n: int) -> None:
        if used + n > self.blocks_per_slot:
            raise BlockPoolExhausted(
                f"a slot holds {self.blocks_per_slot} blocks; {used + n} requested"
            )
        if n > self.num_free:
            raise BlockPoolExhausted(
                f"KV budget exhausted: {n} blocks requested, {self.num_free} free "
                f"of {self.num_blocks}"
            )

    def _check_allocated(self, block_id: int) -> None:
        if block_id not in self._refs:
            raise ValueError(f"block {block_id} is not allocated")
