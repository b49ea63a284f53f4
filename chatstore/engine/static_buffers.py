"""Fixed input buffers of a decode step: what a CUDA graph reads, refilled before each replay.

A captured graph reads and writes the same addresses on every replay, so a decode step's inputs
live in buffers made once, sized for the largest batch-size bucket, and a step of n sequences
runs as the smallest bucket b >= n, its rows n .. b-1 padding:

    one int64 buffer, host (pinned on CUDA) and device, one non-blocking copy a step:
    | ids [M] | positions [M] | slots [M] | seq_lens [M] | block_tables [M, W] |     M = max bucket
      row i < n: sequence i's token, position p, its slot, context p + 1, its block table
      row i >= n (padding): token 0, position 0, slot of the scratch block, context 1,
                            a table of scratch blocks

The scratch block is a pool block held for the engine's life: padding rows write their K, V
there and attend to it alone, so they touch no sequence's KV. `query_start` (0 .. M, one new
token a row) and the logits rows are constants. The step's pre-RoPE K, V go to `kv_out`
[L, 2, M, Hkv, D] (the KV sink inside a graph cannot be a Python hook: see cuda_graphs.py).
"""

from __future__ import annotations

import bisect

import numpy as np
import torch

from chatstore.engine.forward_batch import DeviceSeqLayout, ForwardBatch, SequenceChunk
from chatstore.kernels.paged_decode import make_decode_plan


def decode_buckets(max_running: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8, up to the first bucket that holds `max_running`."""
    buckets = [1]
    while buckets[-1] < max_running:
        last = buckets[-1]
        buckets.append(last * 2 if last < 8 else last + 8)
    return buckets


def bucket_for(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding n sequences; None when n is above the largest."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


class DecodeBuffers:
    def __init__(
        self,
        max_batch: int,
        max_blocks: int,
        block_size: int,
        scratch_block: int,
        kv_out_shape: tuple[int, int, int],  # (layers, Hkv, D)
        kv_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        m, w = max_batch, max_blocks
        self.max_batch, self.max_blocks, self.block_size = m, w, block_size
        self.scratch_block = scratch_block
        self.device = device
        size = 4 * m + m * w
        pinned = device.type == "cuda"
        self.host = torch.empty(size, dtype=torch.long, pin_memory=pinned)  # staging
        self._host_np = self.host.numpy()
        self.flat = torch.empty(size, dtype=torch.long, device=device)
        self.input_ids = self.flat[0:m]  # [M]
        self.positions = self.flat[m : 2 * m]  # [M]
        self.slot_mapping = self.flat[2 * m : 3 * m]  # [M]
        self.seq_lens = self.flat[3 * m : 4 * m]  # [M]
        self.block_tables = self.flat[4 * m :].view(m, w)  # [M, W]
        self.query_start = torch.arange(m + 1, dtype=torch.long, device=device)  # [M + 1]
        self.rows = torch.arange(m, dtype=torch.long, device=device)  # logits rows
        layers, hkv, d = kv_out_shape
        self.kv_out = torch.empty((layers, 2, m, hkv, d), dtype=kv_dtype, device=device)
        self._copied: torch.cuda.Event | None = None
        self.fill_padding(m)

    def fits(self, chunks: list[SequenceChunk]) -> bool:
        """Whether a step is a decode these buffers hold (one token each, tables within W)."""
        return (
            len(chunks) <= self.max_batch
            and all(len(c.token_ids) == 1 for c in chunks)
            and all(len(c.block_table) <= self.max_blocks for c in chunks)
        )

    def fill(self, chunks: list[SequenceChunk], bucket: int) -> None:
        """Write the step's rows, padding up to `bucket`, and copy them to the device."""
        m, w, bs = self.max_batch, self.max_blocks, self.block_size
        n = len(chunks)
        self._wait_for_last_copy()
        ids = np.fromiter((c.token_ids[0] for c in chunks), np.int64, n)
        pos = np.fromiter((c.start_pos for c in chunks), np.int64, n)
        tables = self._host_np[4 * m : 4 * m + bucket * w].reshape(bucket, w)
        tables.fill(self.scratch_block)
        for i, c in enumerate(chunks):
            tables[i, : len(c.block_table)] = c.block_table
        own_block = tables[np.arange(n), pos // bs]
        h = self._host_np
        h[0:n], h[m : m + n], h[3 * m : 3 * m + n] = ids, pos, pos + 1
        h[2 * m : 2 * m + n] = own_block * bs + pos % bs
        self._pad_rows(n, bucket)
        self._copy(4 * m + bucket * w)

    def fill_padding(self, bucket: int) -> None:
        """Every row of `bucket` padding: what a graph is warmed up and captured on."""
        m, w = self.max_batch, self.max_blocks
        self._wait_for_last_copy()
        self._host_np[4 * m : 4 * m + bucket * w] = self.scratch_block
        self._pad_rows(0, bucket)
        self._copy(4 * m + bucket * w)

    def batch(self, bucket: int, chunks: list[SequenceChunk] | None = None) -> ForwardBatch:
        """A ForwardBatch of `bucket` rows over the buffers (views: the same addresses on every
        step). `chunks` (the step's real rows) give the CPU decode kernel its plan."""
        lens, tables = self._host_lists(bucket, chunks or [])
        batch = ForwardBatch(
            input_ids=self.input_ids[:bucket],
            positions=self.positions[:bucket],
            slot_mapping=self.slot_mapping[:bucket],
            query_lens=[1] * bucket,
            context_lens=lens,
            block_tables=self.block_tables[:bucket],
            block_table_lists=tables,
            logits_indices=self.rows[:bucket],
            block_size=self.block_size,
            device_layout=DeviceSeqLayout(
                self.block_tables[:bucket],
                self.query_start[: bucket + 1],
                self.seq_lens[:bucket],
                max_query_len=1,
                # Every length up to a full table: the launch (split-KV or not) is fixed at capture.
                max_seq_len=self.max_blocks * self.block_size,
            ),
        )
        if self.device.type == "cpu":
            batch.decode_plan = make_decode_plan(tables, lens, self.block_size, self.device)
        return batch

    def _host_lists(
        self, bucket: int, chunks: list[SequenceChunk]
    ) -> tuple[list[int], list[list[int]]]:
        lens = [c.context_len for c in chunks] + [1] * (bucket - len(chunks))
        tables = [list(c.block_table) for c in chunks]
        tables += [[self.scratch_block]] * (bucket - len(chunks))
        return lens, tables

    def _pad_rows(self, first: int, bucket: int) -> None:
        m, h = self.max_batch, self._host_np
        h[first:bucket] = 0  # token 0
        h[m + first : m + bucket] = 0  # position 0
        h[2 * m + first : 2 * m + bucket] = self.scratch_block * self.block_size
        h[3 * m + first : 3 * m + bucket] = 1  # attends to its own slot only

    def _copy(self, count: int) -> None:
        self.flat[:count].copy_(self.host[:count], non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()

    def _wait_for_last_copy(self) -> None:
        """The staging buffer is rewritten only after the copy that read it has run."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
