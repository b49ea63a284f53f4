"""The write stream of asynchronous save (CachedAttention §3.2.2): every forward's new pre-RoPE K
and V, layer by layer, kept per request until its turn is saved.

    forward, layer 0:  name the step's kept rows; give each tracked request room for its rows
                       in pages of its own (a row arena), and write their positions there
    forward, layer i:  save_layer(i, k, v, batch) ── one index_copy_ ──► arena rows of layer i
    turn ends:         take(request_id) -> TurnRows (page references, no copy)
    writer thread:     TurnRows.scatter_into(kv, start, end), then TurnRows.release()

Why one copy per layer per forward: decode batches of dozens of sessions must not pay one small
copy per request per layer (bench/save_layer.py). An earlier design got that by keeping one
tensor per step holding the rows of every tracked request of the step, each request pointing
into it; but then a request kept alive every other request's rows of every step it lived
through (32x its own in a batch of 32), and one long request pinned gigabytes after its
neighbours were long saved. Memory must follow requests, the copy must follow steps.

Hence the arena: per-layer storage split into fixed pages (PAGE_ROWS rows) that requests own.
At layer 0 each tracked request appends its step rows to its own last page (or new pages from
the free list), which gives every kept row of the step a destination; each layer then scatters
all of them with one index_copy_ (one per arena segment touched, in practice one). A finished
request's pages go back to the free list when its TurnRows is released (or at once on drop),
so what is held is exactly the live requests' rows rounded up to pages, and freed pages are
reused by the next requests. The free list hands out the lowest page first, which packs live
rows into the first segments: steps rarely span segments, and a trailing segment that empties
while the arena is well over twice what is used can be given back.

The arena grows by adding segments, never by copying: a writer thread reading a taken request's
rows never sees them move. Pages of a taken TurnRows are not on the free list until its
release(), so new requests cannot overwrite them. Allocator state (free list, segments, page
lists) is under one lock: the engine thread allocates (track/save_layer/take/drop), the writer
thread reads and releases.

On CUDA each layer's kept rows are gathered on the device (stack K, V; index_select) into the
step's buffer on a side stream ordered after the compute that produced them, and the step goes
to a preallocated pinned ring in one copy (host_copies.py says when it is one per layer); the
index_copy_ into the CPU arena happens once its fence is done: opportunistically at the next
step's layer 0 on the engine thread, or (waiting) when a writer thread reads rows. Those pending
copies are applied in issue order, so a page freed and reused sees its old owner's late rows
before its new owner's. Positions come from the step's host lists (`host_positions`): no
device-to-host read of them.
"""

from __future__ import annotations

import bisect
import heapq
import threading
from dataclasses import dataclass

import torch

from chatstore.transfer.host_copies import HostCopies
from chatstore.transfer.row_pages import (
    FIRST_SEGMENT_PAGES,
    MAX_SEGMENT_PAGES,
    PAGE_ROWS,
    Segment,
    SegmentPart,
    new_pages,
    slice_runs,
)
from chatstore.transfer.turn_rows import PageRows, TurnRows


@dataclass
class _Step:
    parts: list[SegmentPart]
    kept: torch.Tensor | None  # batch rows kept, None when all (device of the batch)
    count: int


class LayerSaver:
    def __init__(
        self,
        num_layers: int,
        row_dtype: torch.dtype,
        device: torch.device,
        host_copies: HostCopies | None = None,
    ) -> None:
        """row_dtype: what the rows wait in until their chunks are built: the store's dtype, or
        the compute dtype when the store keeps int8 (kv_quant.staging_dtype: a chunk is
        quantised as a whole when it is built, never row by row in a forward). host_copies:
        the device path (None: made on CUDA; tests give one on a CPU)."""
        if not row_dtype.is_floating_point:
            raise ValueError(f"the layer saver keeps float rows, not {row_dtype}")
        self.num_layers = num_layers
        self.row_dtype = row_dtype
        self.device = torch.device(device)
        self.rows_saved = 0  # token rows copied (all layers counted once)
        self._lock = threading.Lock()  # allocator: free list, segments, page lists
        self._tracked: dict[str, PageRows] = {}
        self._segments: list[Segment] = []
        self._first_pages: list[int] = []  # of the segments, for bisect
        self._free: list[int] = []  # heap of free page ids
        self._row_shape: tuple[int, ...] | None = None  # (Hkv, D), known at the first save
        self._page_bytes = 0
        self._step: _Step | None = None
        if host_copies is None and self.device.type == "cuda":
            host_copies = HostCopies(self.device, row_dtype, num_layers)
        self._host_copies = host_copies  # CUDA: rows reach the arena through a host ring

    # -- requests -------------------------------------------------------------------------

    def track(self, request_id: str) -> None:
        """Keep the rows of this request from now on."""
        with self._lock:
            self._tracked.setdefault(request_id, PageRows())

    def take(self, request_id: str) -> TurnRows:
        """What was kept for the request (empty when nothing); it is no longer tracked. Its
        rows stay valid until TurnRows.release()."""
        with self._lock:
            rows = self._tracked.pop(request_id, None)
        return TurnRows(self, rows) if rows is not None else TurnRows()

    def drop(self, request_id: str) -> None:
        """Stop tracking the request and free its rows at once."""
        with self._lock:
            rows = self._tracked.pop(request_id, None)
        if rows is not None:
            self.release_rows(rows)
            rows.released = True

    def held_bytes(self) -> int:
        """Bytes of the pages held by tracked and taken-but-unreleased requests."""
        with self._lock:
            return sum(s.used for s in self._segments) * self._page_bytes

    def arena_bytes(self) -> int:
        with self._lock:
            return sum(s.nbytes() for s in self._segments)

    # -- engine thread --------------------------------------------------------------------

    def save_layer(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        request_ids: list[str],
        query_lens: list[int],
        context_lens: list[int] | None = None,
    ) -> None:
        """Layer `layer`'s new pre-RoPE K, V [T, Hkv, D] of a forward whose rows are the chunks
        of `request_ids` (query_lens rows each, in order). `context_lens` (each chunk's context,
        its rows included) lets a step whose positions [T] sit on a device take them from the
        host instead (no device sync)."""
        if layer == 0:
            positions = host_positions(positions, query_lens, context_lens)
            self._step = self._begin_step(k, positions, request_ids, query_lens)
        step = self._step
        if step is None:
            return
        if layer == self.num_layers - 1:
            self._step = None  # the step's plan would keep a given-back segment alive
        if self._host_copies is not None:
            self._host_copies.issue(layer, k, v, step.kept, step.count, step.parts)
            return
        both = None
        for part in step.parts:
            if part.runs is not None:  # a prefill's rows: one contiguous range each side
                (d0, d1), (b0, b1) = part.runs
                dst = part.segment.kv[layer][d0:d1]
                dst[:, 0].copy_(k[b0:b1])
                dst[:, 1].copy_(v[b0:b1])
                continue
            if both is None:
                both = torch.stack((k, v), dim=1)  # [T, 2, Hkv, D]
                if both.dtype != self.row_dtype:
                    both = both.to(self.row_dtype)
            src = both if part.batch_rows is None else both.index_select(0, part.batch_rows)
            part.segment.kv[layer].index_copy_(0, part.dest, src)

    def _begin_step(
        self,
        k: torch.Tensor,
        positions: torch.Tensor,  # [T] on the host
        request_ids: list[str],
        query_lens: list[int],
    ) -> _Step | None:
        """Give the step's kept rows their arena rows and write their positions there."""
        if len(request_ids) != len(query_lens):
            return None
        if self._host_copies is not None:
            self._host_copies.land(wait=False)
        with self._lock:
            kept: list[tuple[PageRows, int, int]] = []  # (rows, first batch row, count)
            row = total = 0
            for rid, n in zip(request_ids, query_lens, strict=True):
                rows = self._tracked.get(rid)
                if rows is not None and n > 0:
                    kept.append((rows, row, n))
                    total += n
                row += n
            if not kept:
                return None
            self._ensure_arena(tuple(k.shape[1:]))
            self._reserve(sum(new_pages(rows, n) for rows, _, n in kept))
            starts: list[int] = []
            lengths: list[int] = []
            for rows, _, n in kept:
                self._append(rows, n, starts, lengths)
            segments = list(self._segments)
        self.rows_saved += total
        # Destination rows (global) of the kept rows, in batch order.
        if len(starts) == total:
            dest = torch.tensor(starts, dtype=torch.long)
        else:
            lens = torch.tensor(lengths, dtype=torch.long)
            run_first = torch.cumsum(lens, 0) - lens
            dest = torch.repeat_interleave(torch.tensor(starts) - run_first, lens)
            dest += torch.arange(total)
        kept_rows = None
        if total != row:
            kept_rows = torch.cat([torch.arange(r, r + n) for _, r, n in kept])
        cpu_positions = positions.long()
        if kept_rows is not None:
            cpu_positions = cpu_positions.index_select(0, kept_rows)
        parts = []
        if len(segments) == 1 or int(dest.max()) < segments[0].pages * PAGE_ROWS:
            parts.append(SegmentPart(segments[0], kept_rows, None, dest))
        else:
            first_rows = torch.tensor([s.first_row for s in segments])
            seg_of = torch.bucketize(dest, first_rows, right=True) - 1
            for i in seg_of.unique().tolist():
                sel = (seg_of == i).nonzero().flatten()
                seg = segments[i]
                batch = sel if kept_rows is None else kept_rows.index_select(0, sel)
                part = SegmentPart(seg, batch, sel, dest.index_select(0, sel) - seg.first_row)
                parts.append(part)
        for part in parts:
            part.runs = slice_runs(part.dest, part.batch_rows, total)
            step_pos = cpu_positions
            if part.step_rows is not None:
                step_pos = cpu_positions.index_select(0, part.step_rows)
            part.segment.positions.index_copy_(0, part.dest, step_pos)
        device_kept = None
        if self._host_copies is not None and kept_rows is not None:
            device_kept = self._host_copies.on_device(kept_rows, k.device)
        return _Step(parts, device_kept, total)

    # -- allocator (call with self._lock held) --------------------------------------------

    def _ensure_arena(self, row_shape: tuple[int, ...]) -> None:
        if self._row_shape is None:
            self._row_shape = row_shape
            itemsize = torch.empty(0, dtype=self.row_dtype).element_size()
            per_row = self.num_layers * 2 * itemsize
            for d in row_shape:
                per_row *= d
            self._page_bytes = PAGE_ROWS * (per_row + 8)  # + the position (long)
        assert row_shape == self._row_shape, (
            f"rows of shape {row_shape} in a {self._row_shape} arena"
        )

    def _reserve(self, pages: int) -> None:
        """At least `pages` free pages, by adding one segment when short (old ones never move)."""
        if len(self._free) >= pages:
            return
        total = sum(s.pages for s in self._segments)
        size = max(min(max(total, FIRST_SEGMENT_PAGES), MAX_SEGMENT_PAGES), pages - len(self._free))
        assert self._row_shape is not None
        seg = Segment(total, size, self.num_layers, self._row_shape, self.row_dtype)
        self._segments.append(seg)
        self._first_pages.append(seg.first_page)
        for page in range(total, total + size):
            heapq.heappush(self._free, page)

    def _segment_of(self, page: int) -> Segment:
        return self._segments[bisect.bisect_right(self._first_pages, page) - 1]

    @property
    def page_bytes(self) -> int:
        return self._page_bytes

    def _append(self, rows: PageRows, n: int, starts: list[int], lengths: list[int]) -> None:
        """Room for n more rows of `rows`: (first global row, count) runs appended."""
        while n > 0:
            offset = rows.count % PAGE_ROWS
            if offset == 0:
                page = heapq.heappop(self._free)
                self._segment_of(page).used += 1
                rows.pages.append(page)
            run = min(n, PAGE_ROWS - offset)
            starts.append(rows.pages[-1] * PAGE_ROWS + offset)
            lengths.append(run)
            rows.count += run
            n -= run

    def release_rows(self, rows: PageRows) -> None:
        with self._lock:
            for page in rows.pages:
                self._segment_of(page).used -= 1
                heapq.heappush(self._free, page)
            rows.pages = []
            rows.count = 0
            self._shrink()

    def _shrink(self) -> None:
        """Give back trailing empty segments while the rest is over twice what is in use."""
        while len(self._segments) > 1 and self._segments[-1].used == 0:
            last = self._segments[-1]
            used = sum(s.used for s in self._segments)
            if 2 * used > last.first_page:
                return
            self._segments.pop()
            self._first_pages.pop()
            self._free = [p for p in self._free if p < last.first_page]
            heapq.heapify(self._free)

    # -- writer thread --------------------------------------------------------------------

    def locate_rows(self, rows: PageRows) -> tuple[torch.Tensor, torch.Tensor]:
        """Global arena rows of a request's rows and their positions."""
        with self._lock:
            pages = torch.tensor(rows.pages, dtype=torch.long)
            count = rows.count
        index = torch.arange(count)
        global_rows = pages[index // PAGE_ROWS] * PAGE_ROWS + index % PAGE_ROWS
        positions = self._gather(global_rows, lambda seg, local: seg.positions[local])
        return global_rows, positions

    def read_rows(self, global_rows: torch.Tensor) -> torch.Tensor:
        """kv of these arena rows, [L, n, 2, Hkv, D] (a copy). Waits for CUDA copies first."""
        if self._host_copies is not None:
            self._host_copies.land(wait=True)
        return self._gather(global_rows, lambda seg, local: seg.kv.index_select(1, local), dim=1)

    def _gather(self, global_rows: torch.Tensor, read, dim: int = 0) -> torch.Tensor:
        """read(segment, its rows) for the segments holding global_rows, put back in order."""
        with self._lock:
            segments = list(self._segments)
        firsts = torch.tensor([s.first_row for s in segments])
        seg_of = torch.bucketize(global_rows, firsts, right=True) - 1
        used = seg_of.unique().tolist()
        if len(used) == 1:
            seg = segments[used[0]]
            return read(seg, global_rows - seg.first_row)
        out = None
        for i in used:
            sel = (seg_of == i).nonzero().flatten()
            seg = segments[i]
            part = read(seg, global_rows.index_select(0, sel) - seg.first_row)
            if out is None:
                shape = list(part.shape)
                shape[dim] = len(global_rows)
                out = part.new_empty(shape)
            out.index_copy_(dim, sel, part)
        assert out is not None
        return out


def host_positions(
    positions: torch.Tensor, query_lens: list[int], context_lens: list[int] | None
) -> torch.Tensor:
    """The step's positions [T] on the host: the tensor itself on a CPU; on a device, from the
    host lists when given (chunk i's rows are positions context - query .. context - 1), which
    spares the saver a device-to-host copy and the sync it implies every step."""
    if positions.device.type == "cpu" or context_lens is None:
        return positions.cpu()
    rows = [p for q, c in zip(query_lens, context_lens, strict=True) for p in range(c - q, c)]
    return torch.tensor(rows, dtype=torch.long)
