"""The layer saver's CUDA path: a forward's kept rows go device -> pinned host memory on a side
stream, and from there into the CPU arena once the copy has finished.

    issue(layer, k, v)   on the side stream, ordered after the compute that made k, v:
                         stack K, V; index_select the kept rows; copy to pinned host; event
    land(wait=False)     the engine thread at the next step's layer 0: copies whose event fired
    land(wait=True)      a writer thread about to read rows: every copy issued so far

Copies land in issue order, so a page freed and reused sees its old owner's late rows before its
new owner's. Only the engine thread issues; landing is under its own lock, never the arena's, so
the engine never waits behind a writer thread that waits for an event.
"""

from __future__ import annotations

import threading
from collections import deque

import torch

from chatstore.transfer.row_pages import SegmentPart


class HostCopies:
    def __init__(self, device: torch.device, row_dtype: torch.dtype) -> None:
        self.device = device
        self.row_dtype = row_dtype
        self._stream = torch.cuda.Stream(device=device)
        self._pending: deque = deque()  # (seq, event, host rows, layer, parts)
        self._lock = threading.Lock()
        self._seq = 0

    def on_device(self, rows: torch.Tensor, device: torch.device) -> torch.Tensor:
        """`rows` (indices of the kept rows) on the device, usable by the side stream."""
        on_device = rows.to(device)
        on_device.record_stream(self._stream)
        return on_device

    def issue(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        kept: torch.Tensor | None,
        count: int,
        parts: list[SegmentPart],
    ) -> None:
        """The kept rows (None: all `count`) of k, v -> pinned host memory on the side stream,
        after the compute stream produced them; they land in `parts` once the event fired."""
        host = torch.empty((count, 2, *k.shape[1:]), dtype=self.row_dtype, pin_memory=True)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            both = torch.stack((k, v), dim=1)
            if kept is not None:
                both = both.index_select(0, kept)
            host.copy_(both.to(self.row_dtype), non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        k.record_stream(self._stream)
        v.record_stream(self._stream)
        # No lock: deque.append is atomic and only this thread appends, so the engine never
        # waits behind a writer thread that is waiting for an event.
        self._seq += 1
        self._pending.append((self._seq, event, host, layer, parts))

    def land(self, wait: bool) -> None:
        """Land the copies in the arena, in issue order: those already finished (wait False,
        never blocks), or all issued so far (wait True)."""
        if not self._pending or not self._lock.acquire(blocking=wait):
            return
        try:
            upto = self._seq
            while self._pending and self._pending[0][0] <= upto:
                _, event, host, layer, parts = self._pending[0]
                if not wait and not event.query():
                    break
                event.synchronize()
                for part in parts:
                    src = host if part.step_rows is None else host.index_select(0, part.step_rows)
                    part.segment.kv[layer].index_copy_(0, part.dest, src)
                # Only once landed: an empty queue means every copy issued is in the arena.
                self._pending.popleft()
        finally:
            self._lock.release()
