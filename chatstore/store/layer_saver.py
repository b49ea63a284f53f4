"""The write stream of asynchronous save (CachedAttention §3.2.2): every forward's new pre-RoPE K
and V, layer by layer, kept per request until its turn is saved.

    forward, layer i:  save_layer(i, k, v, batch) ── one copy of its rows ──► StepRows.layers[i]
    (layer 0 starts a new StepRows and names which of its rows belong to which request)
    turn ends:         take(request_id) -> TurnRows (references only, no copy)
    writer thread:     TurnRows.scatter_into(kv)   (waits for CUDA copies, then fills the SessionKV)

One copy per layer per forward, whatever the batch size: the engine thread does no per-request
work except at layer 0 (naming rows), so decode batches of dozens of sessions pay one small copy
per layer instead of two per request. Prefill KV is thereby written back layer by layer during
the forward; decode KV every step; the assembly of the whole turn happens on the writer thread
(the write buffer), so the next job never waits for it.

On CUDA the copy is device -> pinned host memory on a side stream of its own (non-blocking, one
event per layer), ordered after the compute that produced the rows; on CPU it is a plain copy
into the storage dtype (the step's qkv tensor cannot be kept instead: it is 2.5x the K, V bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepRows:
    """The rows one forward computed for requests being saved: positions and every layer's K, V."""

    positions: torch.Tensor  # [R] on the CPU
    layers: list[torch.Tensor | None]  # layer -> [R, 2, Hkv, D] in the storage dtype (CPU)
    events: list[object | None] = field(default_factory=list)  # CUDA: copy of layer i finished


@dataclass
class TurnRows:
    """A request's share of the steps it took part in: (step, first row, row count)."""

    chunks: list[tuple[StepRows, int, int]] = field(default_factory=list)

    def positions(self) -> torch.Tensor:
        if not self.chunks:
            return torch.empty(0, dtype=torch.long)
        return torch.cat([step.positions[s : s + n] for step, s, n in self.chunks])

    def max_position(self) -> int:
        """Highest position computed (-1 when none): the turn's KV ends after it."""
        return max((int(step.positions[s : s + n].max()) for step, s, n in self.chunks), default=-1)

    def scatter_into(self, kv: torch.Tensor, limit: int) -> torch.Tensor:
        """Write the rows into kv [L, 2, T, Hkv, D] at their positions (< limit); the bool mask
        [limit] of positions written. Runs on the writer thread."""
        have = torch.zeros(limit, dtype=torch.bool)
        if not self.chunks:
            return have
        pos = self.positions()
        keep = pos < limit
        kept = pos[keep]
        for layer in range(kv.shape[0]):
            parts = []
            for step, s, n in self.chunks:
                _wait(step, layer)
                rows = step.layers[layer]
                assert rows is not None, f"layer {layer} of a step was never saved"
                parts.append(rows[s : s + n])
            rows = torch.cat(parts)[keep]  # [n, 2, Hkv, D]
            kv[layer, :, kept] = rows.transpose(0, 1).to(kv.dtype)
        have[kept] = True
        return have


class LayerSaver:
    def __init__(self, num_layers: int, storage_dtype: torch.dtype, device: torch.device) -> None:
        self.num_layers = num_layers
        self.storage_dtype = storage_dtype
        self.device = torch.device(device)
        self._turns: dict[str, TurnRows] = {}
        self._step: StepRows | None = None
        self._rows: torch.Tensor | None = None  # rows of the step's batch that are kept
        self._stream = None
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=self.device)
        self.rows_saved = 0  # token rows copied (all layers counted once)

    def track(self, request_id: str) -> None:
        """Keep the rows of this request from now on."""
        self._turns.setdefault(request_id, TurnRows())

    def take(self, request_id: str) -> TurnRows:
        """What was kept for the request (empty when nothing); it is no longer tracked."""
        return self._turns.pop(request_id, None) or TurnRows()

    def drop(self, request_id: str) -> None:
        self._turns.pop(request_id, None)

    def save_layer(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        request_ids: list[str],
        query_lens: list[int],
    ) -> None:
        """Layer `layer`'s new pre-RoPE K, V [T, Hkv, D] of a forward whose rows are the chunks
        of `request_ids` (query_lens rows each, in order)."""
        if layer == 0:
            self._begin_step(positions, request_ids, query_lens)
        step, rows = self._step, self._rows
        if step is None:
            return
        if self._stream is None:
            out = torch.empty((len(step.positions), 2, *k.shape[1:]), dtype=self.storage_dtype)
            src_k = k if rows is None else k.index_select(0, rows)
            src_v = v if rows is None else v.index_select(0, rows)
            out[:, 0] = src_k
            out[:, 1] = src_v
            step.layers[layer] = out
        else:
            step.layers[layer], step.events[layer] = self._copy_on_stream(k, v, rows)

    def _begin_step(
        self, positions: torch.Tensor, request_ids: list[str], query_lens: list[int]
    ) -> None:
        """Name the step's rows; only requests being tracked keep theirs."""
        self._step = self._rows = None
        if len(request_ids) != len(query_lens):
            return
        kept: list[tuple[TurnRows, int, int]] = []
        offsets: list[torch.Tensor] = []
        row = out_row = 0
        for rid, n in zip(request_ids, query_lens, strict=True):
            turn = self._turns.get(rid)
            if turn is not None and n > 0:
                kept.append((turn, out_row, n))
                offsets.append(torch.arange(row, row + n))
                out_row += n
            row += n
        if not kept:
            return
        all_rows = out_row == row
        rows = None if all_rows else torch.cat(offsets)
        cpu_positions = positions.cpu()
        step_positions = cpu_positions if rows is None else cpu_positions.index_select(0, rows)
        step = StepRows(step_positions, [None] * self.num_layers, [None] * self.num_layers)
        for turn, start, n in kept:
            turn.chunks.append((step, start, n))
        self._step = step
        self._rows = None if rows is None else rows.to(positions.device)
        self.rows_saved += out_row

    def _copy_on_stream(self, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor | None):
        """CUDA: the rows -> pinned host memory on the side stream, after the compute stream
        produced them; k, v stay alive for the side stream (record_stream)."""
        assert self._stream is not None
        n = k.shape[0] if rows is None else rows.shape[0]
        out = torch.empty((n, 2, *k.shape[1:]), dtype=self.storage_dtype, pin_memory=True)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            both = torch.stack((k, v), dim=1)
            if rows is not None:
                both = both.index_select(0, rows)
            out.copy_(both.to(self.storage_dtype), non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        k.record_stream(self._stream)
        v.record_stream(self._stream)
        return out, event


def _wait(step: StepRows, layer: int) -> None:
    event = step.events[layer] if step.events else None
    if event is not None:
        event.synchronize()  # type: ignore[attr-defined]
