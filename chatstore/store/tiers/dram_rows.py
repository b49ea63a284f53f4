"""Rows of a DRAM tier entry read in place: the pool's blocks themselves, leased, not a copy.

    pool by layer    [L, N, 2, B, Hkv, W]    (the DRAM tier's storage: dram.py)
    block_runs(a, b) the runs of consecutive block ids holding rows [a, b), the same for every
                     layer (a loader plans its copies once, not once a layer); a run's blocks at
                     layer l, `pool[l, block : block + n]`, are one contiguous [n, 2, B, Hkv, W]
                     piece: what a copy to the device reads directly (on CUDA a non-blocking
                     copy from the pinned pool, no pageable intermediate)

A lease keeps the blocks from being handed out again while the rows are read: a block deleted
meanwhile is parked by the tier and freed when its last lease ends, which is when `release()`
is called or the object is collected. Whoever copies from the blocks asynchronously keeps this
object referenced until the copy's fence is done (copy_events.KeptUntilDone).

Everything else that reads a SessionKV sees `kv`: the rows gathered into a fresh tensor on
first use (what DramTier.get_rows returns without in-place reads), so no reader needs to know.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch

from chatstore.store.session_kv import SessionKV


class BlockRun(NamedTuple):
    """Pool blocks [block, block + n) hold value rows [first, first + n * B); rows [lo, hi) of
    the value are wanted from them (at rows [lo - first, hi - first) of the run)."""

    block: int  # the run's first pool block id
    n: int
    first: int  # value row of the run's first pool row (negative: the run starts mid-block)
    lo: int
    hi: int


class PooledRows(SessionKV):
    def __init__(
        self,
        token_ids: list[int],
        by_layer: torch.Tensor,  # [L, N, 2, B, Hkv, W]
        blocks: list[int],
        offset: int,  # the first row's place in blocks[0]
        gather: Callable[[], torch.Tensor],  # the rows as a fresh [L, 2, T, Hkv, W]
        end_lease: Callable[[list[int]], None],
    ) -> None:
        # No SessionKV.__init__: its check would gather the rows.
        self.token_ids = token_ids
        self._by_layer = by_layer
        self._blocks = blocks
        self._offset = offset
        self._gather = gather
        self._kv: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._lease = weakref.finalize(self, end_lease, list(blocks))

    @property
    def kv(self) -> torch.Tensor:
        with self._lock:
            if self._kv is None:
                self._check_leased()
                self._kv = self._gather()
            return self._kv

    @kv.setter
    def kv(self, value: torch.Tensor) -> None:
        self._kv = value

    @property
    def num_layers(self) -> int:
        return self._by_layer.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self._by_layer.dtype

    @property
    def nbytes(self) -> int:
        _, _, _, _, hkv, w = self._by_layer.shape
        return self.num_layers * 2 * self.num_tokens * hkv * w * self._by_layer.element_size()

    @property
    def leased(self) -> bool:
        return self._lease.alive

    def release(self) -> None:
        """End the lease now (the rows must not be read in place afterwards)."""
        self._lease()

    @property
    def pool(self) -> torch.Tensor:
        """The tier's whole pool, [L, N, 2, B, Hkv, W] (runs of two values may be adjacent)."""
        return self._by_layer

    def block_runs(self, start: int, end: int) -> list[BlockRun]:
        """The runs of consecutive pool blocks holding rows [start, end), in row order."""
        self._check_leased()
        B = self._by_layer.shape[3]
        first_block = (self._offset + start) // B
        last_block = -(-(self._offset + end) // B)
        runs = []
        i = first_block
        while i < last_block:
            j = i + 1
            while j < last_block and self._blocks[j] == self._blocks[j - 1] + 1:
                j += 1
            row0 = i * B - self._offset  # value row of the run's first pool row
            lo, hi = max(start, row0), min(end, j * B - self._offset)
            runs.append(BlockRun(self._blocks[i], j - i, row0, lo, hi))
            i = j
        return runs

    def _check_leased(self) -> None:
        if not self._lease.alive:
            raise RuntimeError("rows read in place after their lease ended")
