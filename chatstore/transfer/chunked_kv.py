"""A stored session's KV for a span of positions, as the chunks that hold it (no concatenation
of the whole history): what the layer loader and the read buffer read from.

    ChunkedKV(parts=[(chunk value, first position), ...], start, end)
    layer(i, a, b) -> K, V of positions [a, b) at layer i: a view when one chunk holds the
                      span, else one concatenation of that layer's slices

`LazyChunkedKV` reads the chunks on first use (on whichever thread copies the first layer), so
a load that is never needed never reads a tier.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from chatstore.store.session_kv import SessionKV


class MissingChunkError(RuntimeError):
    """A chunk the load needs is no longer stored (evicted off the last tier, or corrupt)."""


class ChunkedKV:
    def __init__(
        self, parts: list[tuple[SessionKV, int]], start: int, end: int, token_ids: list[int]
    ) -> None:
        self.parts = parts
        self.start = start
        self.end = end
        self.token_ids = token_ids  # the stored session's tokens (all of them)
        # layer_copy's CopyPlans of the spans copied layer by layer, made on the first layer
        # (typed loosely: layer_copy imports this module)
        self.copy_plans: dict[tuple[int, int], object] = {}

    @property
    def num_tokens(self) -> int:
        return self.end

    @property
    def nbytes(self) -> int:
        return sum(value.nbytes for value, _ in self.parts)

    def layer(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        if start < self.start or end > self.end:
            raise ValueError(f"[{start}, {end}) is outside the loaded [{self.start}, {self.end})")
        ks, vs = [], []
        for value, first in self.parts:
            a, b = max(start, first), min(end, first + value.num_tokens)
            if a < b:
                ks.append(value.kv[layer, 0, a - first : b - first])
                vs.append(value.kv[layer, 1, a - first : b - first])
        if len(ks) == 1:
            return ks[0], vs[0]
        return torch.cat(ks), torch.cat(vs)

    def k(self, layer: int) -> torch.Tensor:
        return self.layer(layer, self.start, self.end)[0]

    def v(self, layer: int) -> torch.Tensor:
        return self.layer(layer, self.start, self.end)[1]


class LazyChunkedKV:
    """`fetch()` run once, on the first `layer()` call, by whichever thread gets there first."""

    def __init__(self, fetch: Callable[[], ChunkedKV]) -> None:
        self._fetch = fetch
        self._value: ChunkedKV | None = None
        self._lock = threading.Lock()

    def get(self) -> ChunkedKV:
        with self._lock:
            if self._value is None:
                self._value = self._fetch()
            return self._value

    def layer(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get().layer(layer, start, end)
