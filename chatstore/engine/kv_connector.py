"""The seam between the engine and the session KV store: every hook the engine calls.

Shaped like vLLM's KV connector: the scheduler asks how many leading prompt tokens the store can
supply beyond what the device pool already holds, the store writes that KV into the request's
blocks before (or, layer by layer, during) its prefill, receives every layer's pre-RoPE K and V
as they are computed, and is told when a request finishes so it can keep the session's KV for
the next turn.

    prompt   [ device-cached | store-supplied | computed by this prefill ]
             0      num_computed    +num_external                     len(prompt)

The defaults are the behaviour without a store (NullConnector: every turn recomputes its
history); `chatstore.transfer.StoreConnector` overrides them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from chatstore.engine.forward_batch import ForwardBatch
from chatstore.engine.request import Request

if TYPE_CHECKING:  # the store's contract names what the engine's queue offers
    from chatstore.store.ports import QueueLookahead


@dataclass(frozen=True)
class LoadStats:
    """What loading history KV into the pool did: `EngineStats.load`. All zeros without a
    store. The field names are the keys /admin/cache's `engine` object and the
    `chatstore_engine_*` gauges publish them under."""

    kv_loads: int = 0  # history loads into the pool (synchronous and layer-wise)
    kv_layerwise_loads: int = 0  # of them, copied layer by layer during the forward
    kv_load_wait_s: float = 0.0  # time the forward blocked on a layer not yet copied
    kv_load_copy_s: float = 0.0  # loader-thread time spent copying into the pool
    read_buffer_layers: int = 0  # layers staged ahead per queued session (0 = no read buffer)
    read_buffer_staged: int = 0  # sessions looked up and staged before their job started
    read_buffer_hits: int = 0  # loads that found their session in the read buffer
    read_buffer_layers_used: int = 0  # layers written from the buffer instead of the tier
    read_buffer_bytes: int = 0  # held by the read buffer now


class KVConnector(ABC):
    # save_layer wants the step's rows, named by request (ForwardBatch.request_ids is set)
    saves_kv: bool = False
    # loads run layer by layer during the forward: start_load, wait_for_layer, finish_loads
    layerwise: bool = False

    @abstractmethod
    def num_external_tokens(self, request: Request, num_computed: int) -> int:
        """Leading prompt tokens past `num_computed` whose KV the store can load (0 = none)."""

    @abstractmethod
    def load(self, request: Request, start: int, num_tokens: int, block_table: list[int]) -> None:
        """Write KV for prompt tokens [start, start + num_tokens) into the pool via block_table,
        with RoPE applied at those positions. Must finish (or raise) before the prefill runs."""

    def start_load(
        self, request: Request, start: int, num_tokens: int, block_table: list[int]
    ) -> None:
        """Queue a load to run during this step's forward (`layerwise` connectors)."""
        self.load(request, start, num_tokens, block_table)

    def wait_for_layer(self, layer: int) -> None:
        """Inside the forward, before layer `layer`'s attention: its loaded KV is in the pool."""
        return None

    def finish_loads(self) -> dict[str, Exception]:
        """After the forward: join this step's loads; {request_id: error} of failed ones."""
        return {}

    def set_waiting_queue(self, queue: QueueLookahead) -> None:
        """The scheduler's waiting queue (once, when the engine is built): the one placement's
        look-ahead reads too; a connector with a read buffer stages the sessions queued next."""
        return None

    def look_ahead(self) -> None:
        """A step is scheduled and its loads started (model thread): a chance to read the
        waiting queue and stage the next jobs' KV while this one computes."""
        return None

    def stage(self, tenant: str, session_id: str) -> bool:
        """A hint that this session runs soon; whether anything was staged."""
        return False

    @abstractmethod
    def save_layer(
        self, layer: int, k_pre_rope: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> None:
        """Called inside the forward with the step's new pre-RoPE K and V ([T, Hkv, D])."""

    @abstractmethod
    def request_finished(
        self, request: Request, token_ids: list[int], block_table: list[int]
    ) -> None:
        """The request is done; token_ids (prompt + output) have KV in block_table (the blocks
        are still held by the engine during this call)."""

    def forget(self, request_id: str) -> None:
        """Drop what is held for a request that will never finish normally."""
        return None

    def load_stats(self) -> LoadStats:
        """Counters of loading history KV (EngineStats.load); zeros when nothing is loaded."""
        return LoadStats()

    def close(self) -> None:
        """Stop the connector's own threads (after the engine has stopped)."""
        return None


class NullConnector(KVConnector):
    """No store: every turn recomputes its history (the paper's RE baseline)."""

    def num_external_tokens(self, request: Request, num_computed: int) -> int:
        return 0

    def load(self, request: Request, start: int, num_tokens: int, block_table: list[int]) -> None:
        raise RuntimeError("NullConnector has no KV to load")

    def save_layer(
        self, layer: int, k_pre_rope: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> None:
        return None

    def request_finished(
        self, request: Request, token_ids: list[int], block_table: list[int]
    ) -> None:
        return None
