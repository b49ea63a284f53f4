"""One layer of a stored span onto the pool's device, each host byte copied once, from memory
that a non-blocking copy can read.

    ChunkedKV parts of [start, end)         what crosses to the device, for layer l
    ┌ DRAM, read in place (PooledRows) ──►  each run of consecutive pool blocks (across values:
    │                                       a session's chunks saved together are often
    │                                       adjacent): one copy of its contiguous
    │                                       [n, 2, B, Hkv, W] straight from the pool into one
    │                                       device buffer per group of runs whose rows join
    └ any other value (LMDB, Redis, the  ─► its rows of layer l, K and V, into one staging-ring
      write buffer; fp or int8)             slot with the others' ([2, R, Hkv, W]): one copy
                                            (no slot: a value over the ring, or none free on the
                                            engine thread: a plain copy, see StagingRing.acquire)

The pieces are joined on the device, in position order, as K and V [T, Hkv, W] in the storage
dtype; the caller converts (int8 is dequantised there, on the device) and writes them. The
runs are planned once per span (`CopyPlan`), not once a layer: on a GPU the copies take
microseconds and the host's Python per copy is what a layer-wise load costs (measured on an
H200: 16 runs a layer, 30 layers, 21 ms of host time for 1.8 ms of copying). The result equals
ChunkedKV.layer's bit for bit, on a CPU and on a device.

Host memory read here must outlive the copies: the caller retires the slot with a fence
recorded after the layer's work (`LayerRows.retire`), and keeps the ChunkedKV (which holds the
DRAM leases) until that fence is done.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chatstore.store import kv_quant
from chatstore.store.session_kv import SessionKV
from chatstore.store.tiers.dram_rows import BlockRun, PooledRows
from chatstore.transfer.chunked_kv import ChunkedKV
from chatstore.transfer.copy_events import CopyFence, KeptUntilDone, fence_after_copy
from chatstore.transfer.pinned_staging import StagingRing, StagingSlot


@dataclass
class LayerRows:
    k: torch.Tensor  # [T, Hkv, W] on the device, storage dtype
    v: torch.Tensor
    slot: StagingSlot | None  # the staging slot the copy read, if any
    pooled_runs: int = 0  # pool pieces copied in place
    staged_rows: int = 0  # rows that went through the ring
    plain_rows: int = 0  # rows copied without the ring (no ring, or it refused)

    def retire(self, ring: StagingRing | None, fence: CopyFence) -> None:
        """The layer's copies are enqueued: its slot is free once `fence` is done."""
        if self.slot is not None and ring is not None:
            ring.retire(self.slot, fence)
            self.slot = None


class LayerCopier:
    """The layer loader's side of this: its ring, and the stored rows its copies still read."""

    def __init__(
        self, device: torch.device, dtype: torch.dtype, staging: StagingRing | None
    ) -> None:
        self.device = device
        self.dtype = dtype  # the pool's
        self.staging = staging
        self.kept = KeptUntilDone()  # stored rows whose copies may still be running
        self.pooled_runs = 0  # totals of LayerRows' counts (stats: two threads may add)
        self.staged_rows = 0
        self.plain_rows = 0

    def rows(self, saved: ChunkedKV, layer: int, start: int, end: int, block: bool) -> LayerRows:
        """The layer's rows on the device in the pool's dtype (int8 dequantised there)."""
        self.kept.reap()
        rows = layer_to_device(saved, layer, start, end, self.device, self.staging, block)
        self.pooled_runs += rows.pooled_runs
        self.staged_rows += rows.staged_rows
        self.plain_rows += rows.plain_rows
        rows.k = kv_quant.convert(rows.k, self.dtype, self.device)
        rows.v = kv_quant.convert(rows.v, self.dtype, self.device)
        return rows

    def done(self, rows: LayerRows, saved: ChunkedKV) -> None:
        """The layer's work is enqueued (CUDA) or done (CPU): its slot is free, and its stored
        rows (DRAM leases) may go, once a fence recorded now is done."""
        fence = fence_after_copy(self.device)
        rows.retire(self.staging, fence)
        self.kept.hold(fence, saved)


class PoolGroup:
    """Pool runs whose rows join (each but the last ends at its last block's end, each but the
    first starts at its first block's start): one device buffer, rows [lo, hi) of its blocks."""

    def __init__(self, pool: torch.Tensor, run: BlockRun) -> None:
        self.pool = pool  # [L, N, 2, B, Hkv, W]
        self.B = pool.shape[3]
        self.spans = [(run.block, run.n)]  # (first block, count), in row order
        self.blocks = run.n
        self.lo = run.lo - run.first
        self.hi = run.hi - run.first

    def extend(self, pool: torch.Tensor, run: BlockRun) -> bool:
        """Take `run` if its rows continue this group's in the same pool."""
        if pool is not self.pool or self.hi != self.blocks * self.B or run.lo != run.first:
            return False
        block, n = self.spans[-1]
        if run.block == block + n:  # adjacent in the pool: still one copy
            self.spans[-1] = (block, n + run.n)
        else:
            self.spans.append((run.block, run.n))
        self.hi = self.blocks * self.B + run.hi - run.first
        self.blocks += run.n
        return True

    def to_device(self, layer: int, device: torch.device) -> torch.Tensor:
        """[2, hi - lo, Hkv, W] on `device`: one copy per span (non-blocking from pinned
        memory), then one device-side transpose of the [n, 2, B, ...] blocks."""
        if len(self.spans) == 1:
            block, n = self.spans[0]
            blocks = self.pool[layer, block : block + n].to(device, non_blocking=True)
        else:
            _, _, two, B, hkv, w = self.pool.shape
            blocks = torch.empty(
                (self.blocks, two, B, hkv, w), dtype=self.pool.dtype, device=device
            )
            at = 0
            for block, n in self.spans:
                blocks[at : at + n].copy_(self.pool[layer, block : block + n], non_blocking=True)
                at += n
        n, two, B, hkv, w = blocks.shape
        return blocks.transpose(0, 1).reshape(two, n * B, hkv, w)[:, self.lo : self.hi]


class CopyPlan:
    """What crosses for every layer of [start, end): pool groups and host values, in row order
    (layer-independent, so a layer-wise load plans once)."""

    def __init__(self, saved: ChunkedKV, start: int, end: int) -> None:
        if start < saved.start or end > saved.end:
            raise ValueError(f"[{start}, {end}) is outside the loaded [{saved.start}, {saved.end})")
        self.pieces: list[PoolGroup | tuple[SessionKV, int, int]] = []
        self.leased: list[PooledRows] = []  # values read in place (their leases checked a layer)
        for value, first in saved.parts:
            a, b = max(start, first), min(end, first + value.num_tokens)
            if a >= b:
                continue
            if isinstance(value, PooledRows) and value.leased:
                self.leased.append(value)
                for run in value.block_runs(a - first, b - first):
                    last = self.pieces[-1] if self.pieces else None
                    if not (isinstance(last, PoolGroup) and last.extend(value.pool, run)):
                        self.pieces.append(PoolGroup(value.pool, run))
            else:
                self.pieces.append((value, a - first, b - first))

    @classmethod
    def of(cls, saved: ChunkedKV, start: int, end: int) -> CopyPlan:
        """The plan for the span, made on its first layer and kept on `saved`."""
        plan = saved.copy_plans.get((start, end))
        if not isinstance(plan, CopyPlan):
            plan = saved.copy_plans[(start, end)] = cls(saved, start, end)
        return plan


def layer_to_device(
    saved: ChunkedKV,
    layer: int,
    start: int,
    end: int,
    device: torch.device,
    ring: StagingRing | None,
    block: bool = False,
) -> LayerRows:
    """K, V of positions [start, end) at `layer` on `device` (block: the ring may wait for room,
    for a thread of the loader's own; the engine thread never waits)."""
    plan = CopyPlan.of(saved, start, end)
    for value in plan.leased:
        if not value.leased:
            raise RuntimeError("rows read in place after their lease ended")
    pieces: list[torch.Tensor | None] = []  # [2, rows, Hkv, W] each, on the device
    host: list[tuple[int, torch.Tensor]] = []  # (index in pieces, host rows) to copy over
    pooled = 0
    for piece in plan.pieces:
        if isinstance(piece, PoolGroup):
            pieces.append(piece.to_device(layer, device))
            pooled += len(piece.spans)
        else:
            stored, a, b = piece
            host.append((len(pieces), _host_rows(stored, layer, a, b)))
            pieces.append(None)
    slot, staged, plain = _copy_host_rows(host, pieces, device, ring, block)
    both = _joined(pieces)
    return LayerRows(both[0], both[1], slot, pooled, staged, plain)


def _host_rows(value: SessionKV, layer: int, a: int, b: int) -> torch.Tensor:
    return value.kv[layer, :, a:b]  # [2, rows, Hkv, W]


def _copy_host_rows(
    host: list[tuple[int, torch.Tensor]],
    pieces: list[torch.Tensor | None],
    device: torch.device,
    ring: StagingRing | None,
    block: bool,
) -> tuple[StagingSlot | None, int, int]:
    """The host pieces to the device: through one ring slot when there is one, else each by a
    plain copy. Fills `pieces`; (slot, rows staged, rows copied plainly)."""
    if not host:
        return None, 0, 0
    rows = sum(t.shape[1] for _, t in host)
    sample = host[0][1]
    if any(t.dtype != sample.dtype or t.shape[2:] != sample.shape[2:] for _, t in host):
        ring = None  # values of two storage formats (a change of kv_storage_dtype): one each
    shape = (2, rows, *sample.shape[2:])
    nbytes = sample.element_size() * 2 * rows * sample.shape[2] * sample.shape[3]
    slot = ring.acquire(nbytes, block) if ring is not None else None
    if slot is None:
        for i, t in host:
            pieces[i] = t.to(device)
        return None, 0, rows
    staged = slot.view(shape, sample.dtype)  # [2, R, Hkv, W] of the slot
    r = 0
    for _, t in host:
        staged[:, r : r + t.shape[1]].copy_(t)
        r += t.shape[1]
    on_device = staged.to(device, non_blocking=True)
    r = 0
    for i, t in host:
        pieces[i] = on_device[:, r : r + t.shape[1]]
        r += t.shape[1]
    return slot, rows, 0


def _joined(pieces: list[torch.Tensor | None]) -> torch.Tensor:
    """[2, T, Hkv, W]: the pieces in position order."""
    parts = [p for p in pieces if p is not None]
    if not parts or len(parts) != len(pieces):
        raise ValueError("no stored rows to copy")
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
