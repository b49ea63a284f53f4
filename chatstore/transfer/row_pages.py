"""The layer saver's arena in pages (layer_saver.py): its sizes, a segment of pages, how many
pages a request needs, the part of a step's rows that lands in one segment, and when those rows
move as two slices instead of an index copy."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chatstore.transfer.turn_rows import PageRows

PAGE_ROWS = 16  # rows per page: a request holds at most PAGE_ROWS - 1 rows more than its own
FIRST_SEGMENT_PAGES = 32
MAX_SEGMENT_PAGES = 1024


def new_pages(rows: PageRows, n: int) -> int:
    """Pages a request needs for n more rows beyond the room left in its last page."""
    room = -rows.count % PAGE_ROWS
    return -(-max(0, n - room) // PAGE_ROWS)


class Segment:
    """Arena storage for a contiguous range of pages: kv [L, rows, 2, Hkv, D] and positions."""

    def __init__(self, first_page: int, pages: int, layers: int, row_shape, dtype) -> None:
        rows = pages * PAGE_ROWS
        self.first_page = first_page
        self.pages = pages
        self.used = 0  # pages handed out
        # Made during a forward (inference mode) but written later by other threads too (CUDA
        # copies land on the writer thread): storage, not an inference result.
        with torch.inference_mode(False):
            self.kv = torch.empty((layers, rows, 2, *row_shape), dtype=dtype)
            self.positions = torch.full((rows,), -1, dtype=torch.long)

    @property
    def first_row(self) -> int:
        return self.first_page * PAGE_ROWS

    def nbytes(self) -> int:
        return self.kv.nbytes + self.positions.nbytes


@dataclass
class SegmentPart:
    """The step's rows that land in one segment: which kept rows (None: all) go to which rows."""

    segment: Segment
    batch_rows: torch.Tensor | None  # rows of the forward's batch (CPU path)
    step_rows: torch.Tensor | None  # rows among the step's kept rows (CUDA path, on the host)
    dest: torch.Tensor  # rows of the segment
    runs: tuple[tuple[int, int], tuple[int, int]] | None = None  # (dest, batch) slices, if both
    # are contiguous ranges: then two plain slice copies replace stack + index_copy_


def _contiguous(rows: torch.Tensor) -> tuple[int, int] | None:
    """(first, end) when rows are first, first + 1, ..., end - 1."""
    n = rows.numel()
    if n == 0:
        return None
    first, last = int(rows[0]), int(rows[-1])
    if last - first + 1 != n or (n > 1 and not bool((rows[1:] - rows[:-1] == 1).all())):
        return None
    return first, last + 1


def slice_runs(
    dest: torch.Tensor, batch_rows: torch.Tensor | None, total: int
) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """Slices for a part whose destination and source rows are both contiguous (worth it
    from a few rows on: below that, one index_copy_ costs less than two slice copies)."""
    if dest.numel() < 8:
        return None
    d = _contiguous(dest)
    b = (0, total) if batch_rows is None else _contiguous(batch_rows)
    return (d, b) if d is not None and b is not None else None
