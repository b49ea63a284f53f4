"""The layer saver's device path: a forward's kept rows go device -> host on a side stream,
into a preallocated staging ring (pinned_staging.py, pinned with CUDA), and from there into the
CPU arena once the copy's fence is done.

    issue(layer, k, v)   on the side stream, ordered after the compute that made k, v:
                         stack K, V and take the kept rows into the step's device buffer
                         [L, n, 2, Hkv, D]; at the last layer, one copy of it to a ring slot
    land(wait=False)     the engine thread at the next step's layer 0: copies whose fence is done
    land(wait=True)      a writer thread about to read rows: every copy issued so far

One device-to-host copy per step, not per layer: a step's rows cross once, whatever its number
of layers (a decode step of 32 sessions is 30 small copies otherwise, each a launch and a DMA
set-up for well under 100 KB). It costs the rows' device memory for the length of one forward,
and the host sees them only after the last layer, which is soon enough: they land at the next
step. CUDA-graph decode steps reach here the same way: the graph's forward writes each layer's
pre-RoPE K, V into its fixed `kv_out` buffer, the replay is followed by the sink's layer calls
on a copy of it (cuda_graphs.py), and those fill the same per-step buffer. The per-layer path
remains for a step whose rows do not fit the ring at once (a long prefill): one copy per layer,
each into a slot of its own, and where even that finds no room without waiting, into freshly
allocated pinned memory (the engine thread never waits for the ring to drain).

Ring slots are given back once landed (the copy done and its rows in the arena). Copies land in
issue order, so a page freed and reused sees its old owner's late rows before its new owner's.
Only the engine thread issues; landing is under its own lock, never the arena's, so the engine
never waits behind a writer thread that waits for a fence.

On a CPU (tests) the same code runs without a stream: the copies are done when issued.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from dataclasses import dataclass

import torch

from chatstore.transfer.copy_events import CopyFence, fence_after_copy
from chatstore.transfer.pinned_staging import StagingRing, StagingSlot
from chatstore.transfer.row_pages import SegmentPart


@dataclass
class _Copy:
    seq: int
    fence: CopyFence
    host: torch.Tensor  # [L, n, 2, Hkv, D] (layer None) or [n, 2, Hkv, D]
    layer: int | None  # None: every layer of the step
    parts: list[SegmentPart]
    slot: StagingSlot | None  # None: pinned memory of its own (the ring had no room)


@dataclass
class _StepBuffer:
    rows: torch.Tensor  # [L, n, 2, Hkv, D] on the device
    slot: StagingSlot  # where it goes at the last layer


class HostCopies:
    def __init__(
        self,
        device: torch.device,
        row_dtype: torch.dtype,
        num_layers: int,
        ring: StagingRing | None = None,
    ) -> None:
        self.device = device
        self.row_dtype = row_dtype
        self.num_layers = num_layers
        self.ring = ring if ring is not None else StagingRing()
        cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device=device) if cuda else None
        self._pending: deque[_Copy] = deque()
        self._lock = threading.Lock()
        self._seq = 0
        self._step: _StepBuffer | None = None
        self.step_copies = 0  # one copy for a whole step
        self.layer_copies = 0  # one per layer, into ring slots
        self.unstaged_copies = 0  # one per layer, into pinned memory of their own

    def on_device(self, rows: torch.Tensor, device: torch.device) -> torch.Tensor:
        """`rows` (indices of the kept rows, on the host) on the device, usable by the side
        stream: through a ring slot, so the copy is non-blocking (from pageable memory the
        host would wait for it). On a CPU the rows themselves."""
        if device.type != "cuda":
            return rows
        slot = self.ring.acquire(rows.numel() * rows.element_size())
        if slot is None:
            on_device = rows.to(device)
        else:
            staged = slot.view(tuple(rows.shape), rows.dtype)
            staged.copy_(rows)
            on_device = staged.to(device, non_blocking=True)
            self.ring.retire(slot, fence_after_copy(device))
        if self._stream is not None:
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
        """The kept rows (None: all `count`) of k, v towards the host, on the side stream after
        the compute stream produced them; they land in `parts` once the fence is done."""
        row_shape = (count, 2, *k.shape[1:])
        if layer == 0:
            self._begin_step(row_shape)
        stream = self._stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            both = torch.stack((k, v), dim=1)  # [T, 2, Hkv, D]
            if kept is not None:
                both = both.index_select(0, kept)
            step = self._step
            if step is not None:
                step.rows[layer].copy_(both)
                if layer == self.num_layers - 1:
                    self._step = None
                    host = step.slot.view(tuple(step.rows.shape), self.row_dtype)
                    self._send(host, step.rows, None, parts, step.slot)
                    self.step_copies += 1
            else:
                self._issue_layer(layer, both, row_shape, parts)
        if stream is not None:
            k.record_stream(stream)
            v.record_stream(stream)

    def _begin_step(self, row_shape: tuple[int, ...]) -> None:
        """The step's device buffer and its ring slot, when the ring has room for all of it."""
        if self._step is not None:  # the last step never reached its last layer (it failed)
            self.ring.release(self._step.slot)
            self._step = None
        shape = (self.num_layers, *row_shape)
        slot = self.ring.acquire(_nbytes(shape, self.row_dtype))
        if slot is None:
            return
        with torch.cuda.stream(self._stream) if self._stream else contextlib.nullcontext():
            rows = torch.empty(shape, dtype=self.row_dtype, device=self.device)
        self._step = _StepBuffer(rows, slot)

    def _issue_layer(
        self, layer: int, both: torch.Tensor, row_shape: tuple[int, ...], parts: list[SegmentPart]
    ) -> None:
        self.land(wait=False)  # earlier layers' slots, if their copies are done
        slot = self.ring.acquire(_nbytes(row_shape, self.row_dtype))
        if slot is not None:
            host = slot.view(row_shape, self.row_dtype)
            self.layer_copies += 1
        else:  # no room without waiting: memory of its own, not a wait on the engine thread
            host = torch.empty(row_shape, dtype=self.row_dtype, pin_memory=self.ring.pinned)
            self.unstaged_copies += 1
        self._send(host, both, layer, parts, slot)

    def _send(
        self,
        host: torch.Tensor,
        rows: torch.Tensor,
        layer: int | None,
        parts: list[SegmentPart],
        slot: StagingSlot | None,
    ) -> None:
        """rows -> host (on the current stream: the side stream), and the landing queued."""
        host.copy_(rows, non_blocking=True)  # rows.dtype -> row_dtype on the way, if need be
        fence = fence_after_copy(self.device)
        # No lock: deque.append is atomic and only this thread appends, so the engine never
        # waits behind a writer thread that is waiting for a fence.
        self._seq += 1
        self._pending.append(_Copy(self._seq, fence, host, layer, parts, slot))

    def land(self, wait: bool) -> None:
        """Land the copies in the arena, in issue order: those already done (wait False, never
        blocks), or all issued so far (wait True)."""
        if not self._pending or not self._lock.acquire(blocking=wait):
            return
        try:
            upto = self._seq
            while self._pending and self._pending[0].seq <= upto:
                copy = self._pending[0]
                if not wait and not copy.fence.query():
                    break
                copy.fence.synchronize()
                _land(copy)
                if copy.slot is not None:
                    self.ring.release(copy.slot)
                # Only once landed: an empty queue means every copy issued is in the arena.
                self._pending.popleft()
        finally:
            self._lock.release()


def _land(copy: _Copy) -> None:
    """A landed copy's rows into the arena: one layer, or every layer at once (dim 1)."""
    dim = 0 if copy.layer is not None else 1
    for part in copy.parts:
        src = copy.host
        if part.step_rows is not None:
            src = src.index_select(dim, part.step_rows)
        dst = part.segment.kv if copy.layer is None else part.segment.kv[copy.layer]
        dst.index_copy_(dim, part.dest, src)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
