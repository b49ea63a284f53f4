"""A finished request's rows in the layer saver's arena (layer_saver.py), as the store's writer
reads them: page references, no copy, valid until release()."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class PageRows:
    """A request's pages (global page ids) and how many rows it has written into them."""

    pages: list[int] = field(default_factory=list)
    count: int = 0
    released: bool = False


class RowArena(Protocol):
    """What TurnRows reads through (the LayerSaver; thread-safe: the writer thread calls)."""

    @property
    def page_bytes(self) -> int: ...
    def locate_rows(self, rows: PageRows) -> tuple[torch.Tensor, torch.Tensor]: ...
    def read_rows(self, global_rows: torch.Tensor) -> torch.Tensor: ...
    def release_rows(self, rows: PageRows) -> None: ...


class TurnRows:
    """A request's rows in the arena; valid until release()."""

    def __init__(self, saver: RowArena | None = None, rows: PageRows | None = None) -> None:
        self._saver = saver
        self._rows = rows if rows is not None else PageRows()

    def num_rows(self) -> int:
        return self._rows.count

    def nbytes(self) -> int:
        if self._saver is None:
            return 0
        return len(self._rows.pages) * self._saver.page_bytes

    def positions(self) -> torch.Tensor:
        """Positions of the rows (CPU long), in the order they were computed."""
        located = self._locate()
        return torch.empty(0, dtype=torch.long) if located is None else located[1]

    def max_position(self) -> int:
        """Highest position computed (-1 when none): the turn's KV ends after it."""
        positions = self.positions()
        return int(positions.max()) if len(positions) else -1

    def scatter_into(self, kv: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Write the rows at positions p in [start, end) into kv[:, :, p - start] (kv is
        [L, 2, end - start, Hkv, D], any dtype); the bool mask [end - start] of positions
        written. A position computed twice keeps its later row. Runs on the writer thread."""
        if self._rows.released:
            raise RuntimeError("scatter_into after release()")
        width = max(end - start, 0)
        located = self._locate()
        if located is None or width == 0:
            return torch.zeros(width, dtype=torch.bool)
        assert self._saver is not None
        global_rows, positions = located
        positions = positions - start
        inside = (positions >= 0) & (positions < width)
        # The last row computed for each position in range (-1: none).
        last = torch.full((width,), -1, dtype=torch.long)
        order = torch.arange(len(positions))[inside]
        last.scatter_reduce_(0, positions[inside], order, reduce="amax")
        have = last >= 0
        targets = have.nonzero().flatten()
        if not len(targets):
            return have
        rows = self._saver.read_rows(global_rows.index_select(0, last[targets]))
        rows = rows.transpose(1, 2)  # [L, 2, n, Hkv, D]
        lo, hi = int(targets[0]), int(targets[-1])
        if hi - lo + 1 == len(targets):
            kv[:, :, lo : hi + 1] = rows
        else:
            kv[:, :, targets] = rows.to(kv.dtype)
        return have

    def release(self) -> None:
        """Give the rows back to the arena (idempotent); scatter_into must not follow."""
        if self._saver is not None:
            self._saver.release_rows(self._rows)
        self._rows.released = True

    def _locate(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(arena row, position) of each row, or None when there are none."""
        if self._saver is None or self._rows.count == 0:
            return None
        return self._saver.locate_rows(self._rows)
