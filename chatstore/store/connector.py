"""StoreConnector: the engine's KVConnector backed by the AttentionStore.

    turn n+1 prompt  [ saved history (LCP with the session's tokens) | new tokens ]
                       load(): pre-RoPE K rotated to   | prefill computes these;
                       positions 0.., V as is          | save_layer() keeps their pre-RoPE K, V
    request_finished: saved prefix + computed rows (+ device blocks un-rotated for any gap)
                      -> one SessionKV, committed to the store as a whole turn

What the engine must give: `num_external_tokens` is called (once or more) for every new request
before `load`; in `save_layer`, the batch's rows must be attributable to requests, either by a
`request_ids: list[str]` attribute on ForwardBatch (one per sequence, in chunk order) or by
calling `begin_step(request_ids)` before each forward. Rows of ids the connector does not know
(no session, or extra samples of n > 1) are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from chatstore.engine.forward_batch import ForwardBatch
from chatstore.engine.kv_cache import PagedKVCache
from chatstore.engine.request import Request
from chatstore.engine.rope import RotaryEmbedding
from chatstore.store.attention_store import AttentionStore
from chatstore.store.decoupled import rope_at, unrope
from chatstore.store.session_kv import SessionKV, common_prefix_len


@dataclass
class _Pending:
    request: Request
    saved: SessionKV | None
    reusable: int  # leading prompt tokens the saved KV covers (LCP)
    rows: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = field(
        default_factory=dict
    )  # layer -> [(positions [t], k_pre [t, H, D], v [t, H, D])]


class StoreConnector:
    def __init__(self, store: AttentionStore, kv_cache: PagedKVCache, rope: RotaryEmbedding):
        self.store = store
        self.kv_cache = kv_cache
        self.rope = rope
        self._pending: dict[str, _Pending] = {}
        self._step_ids: list[str] | None = None

    # -- before the prefill -------------------------------------------------------------------

    def num_external_tokens(self, request: Request, num_computed: int) -> int:
        pending = self._pending.get(request.request_id) or self._start(request)
        return max(0, pending.reusable - num_computed)

    def _start(self, request: Request) -> _Pending:
        saved = None
        if request.session_id is not None:
            saved = self.store.lookup(request.tenant, request.session_id)
        reusable = 0
        if saved is not None:
            # Keep at least one prompt token to compute: its logits give the first new token.
            lcp = common_prefix_len(saved.token_ids, request.prompt_token_ids)
            reusable = min(lcp, len(request.prompt_token_ids) - 1)
        pending = _Pending(request, saved, reusable)
        self._pending[request.request_id] = pending
        return pending

    def load(self, request: Request, start: int, num_tokens: int, block_table: list[int]) -> None:
        pending = self._pending.get(request.request_id)
        end = start + num_tokens
        if pending is None or pending.saved is None or end > pending.reusable:
            raise RuntimeError(f"request {request.request_id}: no saved KV for [{start}, {end})")
        positions = torch.arange(start, end)
        slots = _slots(block_table, positions, self.kv_cache.block_size).to(self.kv_cache.device)
        dev_positions = positions.to(self.kv_cache.device)
        for layer in range(self.kv_cache.spec.num_layers):
            k = pending.saved.k(layer)[start:end].to(self.kv_cache.device)
            v = pending.saved.v(layer)[start:end].to(self.kv_cache.device)
            k = rope_at(k, dev_positions, self.rope, self.kv_cache.dtype)
            self.kv_cache.write(layer, k, v, slots)

    # -- during the forward -------------------------------------------------------------------

    def begin_step(self, request_ids: list[str]) -> None:
        """Name the batch's sequences (chunk order) when ForwardBatch carries no request_ids."""
        self._step_ids = list(request_ids)

    def save_layer(
        self, layer: int, k_pre_rope: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> None:
        ids = getattr(batch, "request_ids", None) or self._step_ids
        if not ids or len(ids) != batch.num_seqs:
            return
        dtype = self.store.settings.storage_dtype
        row = 0
        for rid, n in zip(ids, batch.query_lens, strict=True):
            pending = self._pending.get(rid)
            if pending is not None and pending.request.session_id is not None:
                pending.rows.setdefault(layer, []).append(
                    (
                        batch.positions[row : row + n].cpu(),
                        k_pre_rope[row : row + n].to("cpu", dtype, copy=True),
                        v[row : row + n].to("cpu", dtype, copy=True),
                    )
                )
            row += n

    # -- after the turn -----------------------------------------------------------------------

    def request_finished(
        self, request: Request, token_ids: list[int], block_table: list[int]
    ) -> None:
        pending = self._pending.pop(request.request_id, None)
        if self._step_ids is not None and request.request_id in self._step_ids:
            self._step_ids = None
        if request.session_id is None or not token_ids:
            return
        value = self._assemble(pending, token_ids, block_table)
        if value.num_tokens > 0:
            self.store.save(request.tenant, request.session_id, value)

    def forget(self, request_id: str) -> None:
        """Drop what the connector holds for a request that will never finish normally."""
        self._pending.pop(request_id, None)

    def _assemble(
        self, pending: _Pending | None, token_ids: list[int], block_table: list[int]
    ) -> SessionKV:
        spec, B = self.kv_cache.spec, self.kv_cache.block_size
        n = min(len(token_ids), len(block_table) * B)
        if pending is not None and pending.rows.get(0):
            # The last sampled token is never fed back: its KV does not exist.
            n = min(n, 1 + max(int(p.max()) for p, _, _ in pending.rows[0]))
        shape = (spec.num_layers, 2, n, spec.num_kv_heads, spec.head_dim)
        kv = torch.empty(shape, dtype=self.store.settings.storage_dtype)
        have = torch.zeros(n, dtype=torch.bool)
        if pending is not None and pending.saved is not None:
            m = min(pending.reusable, n)
            kv[:, :, :m] = pending.saved.kv[:, :, :m]
            have[:m] = True
        for layer, rows in (pending.rows if pending is not None else {}).items():
            pos = torch.cat([p for p, _, _ in rows])
            keep = pos < n
            kv[layer, 0, pos[keep]] = torch.cat([k for _, k, _ in rows])[keep]
            kv[layer, 1, pos[keep]] = torch.cat([v for _, _, v in rows])[keep]
            if layer == 0:
                have[pos[keep]] = True
        missing = (~have).nonzero().flatten()
        if len(missing):
            self._fill_from_device(kv, missing, block_table)
        return SessionKV(list(token_ids[:n]), kv)

    def _fill_from_device(
        self, kv: torch.Tensor, positions: torch.Tensor, block_table: list[int]
    ) -> None:
        """Tokens the connector never saw computed (device prefix cache): un-rotate pool K."""
        cache = self.kv_cache
        slots = _slots(block_table, positions, cache.block_size).to(cache.device)
        flat = (cache.num_blocks * cache.block_size, cache.spec.num_kv_heads, cache.spec.head_dim)
        dev_positions = positions.to(cache.device)
        for layer in range(cache.spec.num_layers):
            k = cache.k(layer).reshape(flat).index_select(0, slots)
            v = cache.v(layer).reshape(flat).index_select(0, slots)
            kv[layer, 0, positions] = unrope(k, dev_positions, self.rope).to("cpu", kv.dtype)
            kv[layer, 1, positions] = v.to("cpu", kv.dtype)


def _slots(block_table: list[int], positions: torch.Tensor, block_size: int) -> torch.Tensor:
    table = torch.tensor(block_table, dtype=torch.long)
    return table[positions // block_size] * block_size + positions % block_size


def create_connector(store: AttentionStore | None, kv_cache: PagedKVCache, rope: RotaryEmbedding):
    """StoreConnector over `store`, or the recompute baseline (NullConnector) when it is None."""
    from chatstore.engine.kv_connector import NullConnector

    return NullConnector() if store is None else StoreConnector(store, kv_cache, rope)
