"""The seam between the engine and the session KV store (AttentionStore).

Shaped like vLLM's KV connector: the scheduler asks how many leading prompt tokens the store can
supply beyond what the device pool already holds, the store writes that KV into the request's
blocks before its prefill, receives every layer's pre-RoPE K and V as they are computed, and is
told when a request finishes so it can keep the session's KV for the next turn.

    prompt   [ device-cached | store-supplied | computed by this prefill ]
             0      num_computed    +num_external                     len(prompt)
"""

from __future__ import annotations

from typing import Protocol

import torch

from chatstore.engine.forward_batch import ForwardBatch
from chatstore.engine.request import Request


class KVConnector(Protocol):
    def num_external_tokens(self, request: Request, num_computed: int) -> int:
        """Leading prompt tokens past `num_computed` whose KV the store can load (0 = none)."""
        ...

    def load(self, request: Request, start: int, num_tokens: int, block_table: list[int]) -> None:
        """Write KV for prompt tokens [start, start + num_tokens) into the pool via block_table,
        with RoPE applied at those positions. Must finish (or raise) before the prefill runs."""
        ...

    def save_layer(
        self, layer: int, k_pre_rope: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> None:
        """Called inside the forward with the step's new pre-RoPE K and V ([T, Hkv, D])."""
        ...

    def request_finished(
        self, request: Request, token_ids: list[int], block_table: list[int]
    ) -> None:
        """The request is done; token_ids (prompt + output) have KV in block_table (the blocks
        are still held by the engine during this call)."""
        ...


class NullConnector:
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
