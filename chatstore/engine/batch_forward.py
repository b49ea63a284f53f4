"""One forward of a step's scheduled sequences: each one's next tokens as a chunk of a
ForwardBatch, the rows named per request for the connector's KV sink (`save_layer`), and a
mixed batch (decodes beside prefill chunks) run as two forwards where the runner cannot run it
in place; a decode step through the decode graphs when the engine has them (cuda_graphs.py).

    items     [d0, p0, d1]             decode (1 token) and prefill chunks, scheduler order
    split     [d0, d1] + [p0]          two forwards, logits put back in item order
    logits    [len(items), V]          each item's last token
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from chatstore.engine.block_manager import BlockManager
from chatstore.engine.cuda_graphs import decode_graphs_for
from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.forward_batch import ForwardBatch, SequenceChunk
from chatstore.engine.kv_connector import KVConnector
from chatstore.engine.runner import KVSink
from chatstore.engine.runtime import Runtime
from chatstore.engine.scheduler import ScheduledSeq
from chatstore.engine.sequence import Sequence

LayerReady = Callable[[int], None]  # called before layer i's attention (a layer-wise load)


class BatchForward:
    def __init__(
        self, runtime: Runtime, config: EngineConfig, blocks: BlockManager, connector: KVConnector
    ) -> None:
        self.runtime = runtime
        self.config = config
        self.blocks = blocks
        self.connector = connector
        self.graphs = decode_graphs_for(runtime, config, connector.saves_kv)

    def __call__(
        self, items: list[ScheduledSeq], layer_ready: LayerReady | None = None
    ) -> torch.Tensor:
        """Logits [len(items), V] of each item's last token."""
        if self.graphs is not None and layer_ready is None:
            chunks = _chunks(items)
            if self.graphs.accepts(chunks):
                sink, ids = self._sink(items)
                return self.graphs.run(chunks, ids, sink)
        decode = [i for i, it in enumerate(items) if it.num_tokens == 1]
        split = self.config.split_mixed_batches
        if split is None:
            split = not self.runtime.runner.mixed_batches_in_place
        if not split or len(decode) in (0, len(items)):
            return self._run(items, layer_ready)
        prefill = [i for i in range(len(items)) if i not in set(decode)]
        # layer_ready for both: a loaded prompt may leave a one-token chunk, taken for a decode.
        first = self._run([items[i] for i in decode], layer_ready)
        logits = torch.empty((len(items), first.shape[1]), dtype=first.dtype, device=first.device)
        logits[torch.tensor(decode, device=first.device)] = first
        rest = self._run([items[i] for i in prefill], layer_ready)
        logits[torch.tensor(prefill, device=first.device)] = rest
        return logits

    def _run(self, items: list[ScheduledSeq], layer_ready: LayerReady | None) -> torch.Tensor:
        runner = self.runtime.runner
        batch = ForwardBatch.build(_chunks(items), self.blocks.block_size, runner.device)
        sink, batch.request_ids = self._sink(items)
        if layer_ready is None:
            return runner.forward(batch, kv_sink=sink)
        return runner.forward(batch, kv_sink=sink, layer_ready=layer_ready)

    def _sink(self, items: list[ScheduledSeq]) -> tuple[KVSink | None, list[str] | None]:
        """The connector's KV sink and the rows' request ids, when it saves KV. The ids let
        save_layer attribute rows to requests (chunk order); samples after the first of n > 1
        get their own "<id>#<index>" so they are not taken for sample 0."""
        if not self.connector.saves_kv:
            return None, None
        return self.connector.save_layer, [row_id(it.seq) for it in items]


def _chunks(items: list[ScheduledSeq]) -> list[SequenceChunk]:
    chunks = []
    for it in items:
        seq, start = it.seq, it.seq.num_computed
        ids = seq.token_ids[start : start + it.num_tokens]
        chunks.append(SequenceChunk(ids, start, seq.block_table))
    return chunks


def row_id(seq: Sequence) -> str:
    rid = seq.request.request_id
    return rid if seq.sample_index == 0 else f"{rid}#{seq.sample_index}"
