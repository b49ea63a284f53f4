"""A fixed host buffer that copies to and from the device pass through: pinned when CUDA is
present (a non-blocking copy needs page-locked memory; from pageable memory the driver stages
through a buffer of its own and the host waits), plain memory otherwise, allocated once.

    buffer  [ ... free ... | s3 | s4 | s5 | ... free ... ]      capacity bytes
                             ^oldest           ^head: the next slot starts here (or at 0,
                                                      wrapping, when it does not fit the end)

Slots are handed out ring-wise, each a byte range aligned to ALIGN. A slot is given back by
`retire(slot, fence)` once its copy is enqueued: it becomes free when the fence (copy_events.py:
a CUDA event recorded after the copy; on a CPU one already done) reports the copy done, or by
`release(slot)` when the holder knows it is done with it. Space is reused only from the oldest
slot on: a slot retired before an older one waits for it (copies on one stream finish in order,
so this costs nothing on the loader's stream, and it keeps the allocator a head and a queue).

`acquire` with block=False (the engine thread) never waits: no room -> None, and the caller
copies another way. With block=True (a copying thread of its own) it waits for the oldest slots'
fences. A request larger than the whole ring can never be served: None at once, whatever
`block` says, and the caller falls back to a plain copy (see acquire).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import torch

from chatstore.transfer.copy_events import CopyFence

# 64 MiB: a layer of a 4K-token history is 3 MiB for the default model in bf16 and 8 MiB for a
# Llama-3.2-1B shape, so several layers' copies can be in flight; a decode step's rows are well
# under 1 MiB. Pinned memory is taken from the OS for good, so the ring stays this small.
DEFAULT_RING_BYTES = 64 << 20
ALIGN = 256  # slot starts: any dtype's view is aligned, and DMA likes it


@dataclass(eq=False)
class StagingSlot:
    """Bytes [start, end) of the ring, handed to one copy."""

    start: int
    end: int
    data: torch.Tensor  # uint8 [end - start], a view of the ring's buffer
    fence: CopyFence | None = None  # set by retire
    released: bool = False

    def view(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The slot's first bytes as a contiguous tensor of `shape` and `dtype`."""
        n = 1
        for d in shape:
            n *= d
        size = n * torch.empty((), dtype=dtype).element_size()
        return self.data[:size].view(dtype).view(shape)

    def free(self) -> bool:
        return self.released or (self.fence is not None and self.fence.query())


class StagingRing:
    def __init__(self, capacity_bytes: int = DEFAULT_RING_BYTES, pin: bool | None = None) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.capacity = capacity_bytes
        self.pinned = torch.cuda.is_available() if pin is None else pin
        self._buffer: torch.Tensor | None = None  # allocated on first use
        self._slots: deque[StagingSlot] = deque()  # in allocation order
        self._cond = threading.Condition()
        self.served = 0  # slots handed out
        self.refused = 0  # requests answered None (too large, or no room without waiting)

    # -- handing out -------------------------------------------------------------------------

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.capacity

    def acquire(self, nbytes: int, block: bool = False) -> StagingSlot | None:
        """A slot of at least nbytes, or None: the caller copies without the ring. A request
        over the capacity gets None at once: waiting would never make room for it, and a
        larger ring for a rare value would hold its pinned memory for good, while a plain
        copy of that one value only costs its own speed (pageable, the host waits for it)."""
        if not self.fits(nbytes):
            with self._cond:
                self.refused += 1
            return None
        nbytes = max(nbytes, 1)
        with self._cond:
            while True:
                self._reclaim()
                slot = self._place(nbytes)
                if slot is not None:
                    self.served += 1
                    return slot
                if not block:
                    self.refused += 1
                    return None
                oldest = self._slots[0]  # the ring is not empty, or the slot would have fit
                if oldest.fence is None or oldest.released:
                    self._cond.wait(0.01)  # its holder has not retired it yet
                    continue
                fence = oldest.fence
                self._cond.release()
                try:
                    fence.synchronize()  # outside the lock: others may retire meanwhile
                finally:
                    self._cond.acquire()

    def _place(self, nbytes: int) -> StagingSlot | None:
        """A slot at the head, or wrapped to the start, or None (call with the lock held)."""
        if self._buffer is None:
            self._buffer = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=self.pinned)
        size = -(-nbytes // ALIGN) * ALIGN
        if not self._slots:
            start = 0
        else:
            oldest, head = self._slots[0].start, self._slots[-1].end
            if head > oldest:  # used: [oldest, head); free: [head, capacity) and [0, oldest)
                if head + nbytes <= self.capacity:
                    start = head
                elif nbytes <= oldest:
                    start = 0
                else:
                    return None
            elif head + nbytes <= oldest:  # wrapped: used [oldest, cap) + [0, head); starts
                # are ALIGN multiples, so the rounded-up slot ends by `oldest` too
                start = head
            else:
                return None
        end = min(start + size, self.capacity)
        slot = StagingSlot(start, end, self._buffer[start:end])
        self._slots.append(slot)
        return slot

    # -- giving back -------------------------------------------------------------------------

    def retire(self, slot: StagingSlot, fence: CopyFence) -> None:
        """The slot's copy is enqueued: free once `fence` reports it done."""
        with self._cond:
            slot.fence = fence
            self._reclaim()
            self._cond.notify_all()

    def release(self, slot: StagingSlot) -> None:
        """The holder is done with the slot (its copy finished, and it was read)."""
        with self._cond:
            slot.released = True
            self._reclaim()
            self._cond.notify_all()

    def _reclaim(self) -> None:
        while self._slots and self._slots[0].free():
            self._slots.popleft()

    def in_use(self) -> int:
        """Slots handed out and not yet free (done slots behind an older one included)."""
        with self._cond:
            self._reclaim()
            return len(self._slots)
