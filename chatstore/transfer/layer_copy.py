"""One layer of a stored span onto the pool's device, each host byte copied once, from memory
that a non-blocking copy can read.

    ChunkedKV parts of [start, end)         what crosses to the device, for layer l
    ┌ DRAM, read in place (PooledRows) ──►  each run of consecutive pool blocks: one copy of its
    │                                       contiguous [n, 2, B, Hkv, W] straight from the pool
    └ any other value (LMDB, Redis, the  ─► its rows of layer l, K and V, into one staging-ring
      write buffer; fp or int8)             slot with the others' ([2, R, Hkv, W]): one copy
                                            (no slot: a value over the ring, or none free on the
                                            engine thread: a plain copy, see StagingRing.acquire)

The pieces are joined on the device, in position order, as K and V [T, Hkv, W] in the storage
dtype; the caller converts (int8 is dequantised there, on the device) and writes them. On a CPU
every "copy" to the device is the host tensor itself: the pieces are views of the pool, the
slot or the value, and the result equals ChunkedKV.layer's bit for bit.

Host memory read here must outlive the copies: the caller retires the slot with a fence
recorded after the layer's work (`LayerRows.retire`), and keeps the ChunkedKV (which holds the
DRAM leases) until that fence is done.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chatstore.store import kv_quant
from chatstore.store.session_kv import SessionKV
from chatstore.store.tiers.dram_rows import PooledRows
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
    if start < saved.start or end > saved.end:
        raise ValueError(f"[{start}, {end}) is outside the loaded [{saved.start}, {saved.end})")
    pieces: list[torch.Tensor | None] = []  # [2, rows, Hkv, W] each, on the device
    host: list[tuple[int, torch.Tensor]] = []  # (index in pieces, host rows) to copy over
    pooled = 0
    for value, first in saved.parts:
        a, b = max(start, first), min(end, first + value.num_tokens)
        if a >= b:
            continue
        if isinstance(value, PooledRows) and value.leased:
            for run in value.layer_runs(layer, a - first, b - first):
                pieces.append(
                    _from_pool(run.blocks, run.lo - run.first, run.hi - run.first, device)
                )
                pooled += 1
        else:
            host.append((len(pieces), _host_rows(value, layer, a - first, b - first)))
            pieces.append(None)
    slot, staged, plain = _copy_host_rows(host, pieces, device, ring, block)
    both = _joined(pieces)
    return LayerRows(both[0], both[1], slot, pooled, staged, plain)


def _from_pool(blocks: torch.Tensor, lo: int, hi: int, device: torch.device) -> torch.Tensor:
    """Rows [lo, hi) of a run's [n, 2, B, Hkv, W] pool piece, as [2, hi - lo, Hkv, W] on the
    device: the piece is contiguous, so it crosses as it is (non-blocking from pinned memory)."""
    n, _, B, hkv, w = blocks.shape
    on_device = blocks.to(device, non_blocking=True)
    return on_device.transpose(0, 1).reshape(2, n * B, hkv, w)[:, lo:hi]


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
