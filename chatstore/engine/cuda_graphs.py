"""Decode steps replayed as CUDA graphs, one per batch-size bucket (static_buffers.py).

    setup      buckets 1, 2, 4, 8, 16, ... up to max_running; on CUDA each is warmed up once
               and captured, largest first, into one memory pool (a smaller graph's
               allocations fit in what the larger ones gave back)
    each step  a decode of n <= largest bucket, no layer-wise load running:
               fill the buffers (one pinned staging buffer, one non-blocking copy), replay
               bucket(n)'s graph, sample outside it from its logits rows 0 .. n-1;
               anything else (prefill, mixed steps, bigger batches, a load) runs eagerly

The KV sink cannot run inside a graph (a replay runs no Python), so the captured forward's sink
only copies each layer's pre-RoPE K, V into the buffers' `kv_out`; after the replay the real
sink (the store's saver) gets them, layer by layer, from one per-step copy of those rows, and
sends the step's kept rows to the host in one device-to-host copy (transfer/host_copies.py).

Without capture (a CPU, or `capture=False`) the same path runs the forward eagerly over the
same buffers, padding and buckets, so CPU tests pin it to the eager path.
"""

from __future__ import annotations

import torch

from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.forward_batch import ForwardBatch, SequenceChunk
from chatstore.engine.runner import KVSink, ModelRunner
from chatstore.engine.runtime import Runtime
from chatstore.engine.static_buffers import DecodeBuffers, bucket_for, decode_buckets


def decode_graphs_for(
    runtime: Runtime, config: EngineConfig, saves_kv: bool
) -> DecodeGraphs | None:
    """The engine's decode graphs as `config.cuda_graphs` asks (None: on CUDA with Triton's
    attention, captured; True: also on a CPU, run without capture; False: none). Takes the
    scratch block out of the pool for the engine's life."""
    runner, setting = runtime.runner, config.cuda_graphs
    if setting is False or (setting is None and runner.device.type != "cuda"):
        return None
    if runner.layout.name != "paged":
        if setting:
            raise ValueError("cuda_graphs needs the paged KV layout")
        return None
    capture = runner.device.type == "cuda"
    if capture and not runner.triton_attention:
        if setting:
            raise ValueError("cuda_graphs on CUDA needs Triton's attention (install triton)")
        return None
    max_len = config.max_model_len or runtime.model.spec.max_context
    max_blocks = -(-max_len // runtime.block_size)
    (scratch,) = runtime.pool.allocate(1)
    return DecodeGraphs(runner, config.max_running, max_blocks, scratch, saves_kv, capture)


class _Captured:
    def __init__(self, graph: torch.cuda.CUDAGraph, logits: torch.Tensor) -> None:
        self.graph = graph
        self.logits = logits  # [bucket, V], written by every replay


class DecodeGraphs:
    def __init__(
        self,
        runner: ModelRunner,
        max_running: int,
        max_blocks: int,
        scratch_block: int,
        saves_kv: bool,
        capture: bool,
    ) -> None:
        """`scratch_block`: a pool block the caller holds for good (padding rows write there).
        `saves_kv`: the forward keeps its pre-RoPE K, V for a sink (the store's saver)."""
        spec, cache = runner.spec, runner.kv_cache
        self.runner = runner
        self.buckets = decode_buckets(max_running)
        self.buffers = DecodeBuffers(
            self.buckets[-1],
            max_blocks,
            cache.block_size,
            scratch_block,
            (spec.num_layers, spec.num_kv_heads, spec.head_dim),
            cache.dtype,
            runner.device,
        )
        self.saves_kv = saves_kv
        self.replays = 0  # steps served by this path (captured or not)
        self._graphs: dict[int, _Captured] = {}
        if capture:
            self._capture_all()

    @property
    def captured(self) -> list[int]:
        return sorted(self._graphs)

    def accepts(self, chunks: list[SequenceChunk]) -> bool:
        return self.buffers.fits(chunks)

    def run(
        self, chunks: list[SequenceChunk], request_ids: list[str] | None, sink: KVSink | None
    ) -> torch.Tensor:
        """Logits [n, V] (fp32) of a decode step the buffers accept (`accepts`)."""
        n = len(chunks)
        bucket = bucket_for(n, self.buckets)
        assert bucket is not None, f"a decode of {n} is above the largest bucket"
        self.buffers.fill(chunks, bucket)
        captured = self._graphs.get(bucket)
        if captured is not None:
            captured.graph.replay()
            logits = captured.logits[:n].clone()  # the next replay rewrites it
        else:
            batch = self.buffers.batch(bucket, chunks)
            own_sink = self._buffer_sink(bucket) if self.saves_kv else None
            logits = self.runner.forward(batch, kv_sink=own_sink)[:n]
        self.replays += 1
        if sink is not None and self.saves_kv:
            self._hand_over(chunks, request_ids, sink)
        return logits

    def _hand_over(
        self, chunks: list[SequenceChunk], request_ids: list[str] | None, sink: KVSink
    ) -> None:
        """The step's pre-RoPE K, V rows to the real sink, layer by layer, as a batch of the
        n real rows. On CUDA from one copy of them: the saver reads on its own stream while
        the next replay may already rewrite `kv_out`."""
        n = len(chunks)
        kv = self.buffers.kv_out[:, :, :n]  # [L, 2, n, Hkv, D]
        if kv.device.type == "cuda":
            kv = kv.clone()
        batch = self._real_rows(chunks, request_ids)
        for layer in range(kv.shape[0]):
            sink(layer, kv[layer, 0], kv[layer, 1], batch)

    def _real_rows(
        self, chunks: list[SequenceChunk], request_ids: list[str] | None
    ) -> ForwardBatch:
        b, n = self.buffers, len(chunks)
        return ForwardBatch(
            input_ids=b.input_ids[:n],
            positions=b.positions[:n],
            slot_mapping=b.slot_mapping[:n],
            query_lens=[1] * n,
            context_lens=[c.context_len for c in chunks],
            block_tables=b.block_tables[:n],
            block_table_lists=[list(c.block_table) for c in chunks],
            logits_indices=b.rows[:n],
            block_size=b.block_size,
            request_ids=request_ids,
        )

    def _buffer_sink(self, bucket: int) -> KVSink:
        kv_out = self.buffers.kv_out

        def into_buffers(layer: int, k: torch.Tensor, v: torch.Tensor, _: ForwardBatch) -> None:
            kv_out[layer, 0, :bucket].copy_(k)  # [bucket, Hkv, D]
            kv_out[layer, 1, :bucket].copy_(v)

        return into_buffers

    def _capture_all(self) -> None:
        """Warm up and capture every bucket, largest first, into one memory pool."""
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):
            self.buffers.fill_padding(bucket)
            batch = self.buffers.batch(bucket)
            sink = self._buffer_sink(bucket) if self.saves_kv else None
            self._warm_up(self.runner, batch, sink)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.runner.forward(batch, kv_sink=sink)
            self._graphs[bucket] = _Captured(graph, logits)
        torch.cuda.synchronize()

    @staticmethod
    def _warm_up(runner: ModelRunner, batch: ForwardBatch, sink: KVSink | None) -> None:
        """One eager run on a side stream (Triton compiles its kernels, allocators settle), as
        torch's graph capture asks."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            runner.forward(batch, kv_sink=sink)
        torch.cuda.current_stream().wait_stream(side)
