"""The end of a turn: its tokens handed to the store (`KVSource.save_turn`, one call), which
plans their chain against what it holds and asks for a builder of the new chunks, made from the
rows the layer saver kept, the stored base chunk's rows (a ChunkDelta) and, for tokens the
connector never saw computed (the device prefix cache's), the pool's blocks un-rotated.
"""

from __future__ import annotations

import torch

from chatstore.engine.kv_cache import PagedKVCache
from chatstore.engine.request import Request
from chatstore.engine.rope import RotaryEmbedding
from chatstore.store import kv_quant
from chatstore.store.ports import (
    ChunkBuilder,
    ChunkDelta,
    ChunkKey,
    KVSource,
    OpenedTurn,
    StoredSession,
    TurnPlan,
)
from chatstore.store.session_kv import SessionKV
from chatstore.transfer.layer_saver import TurnRows
from chatstore.transfer.rerope import unrope


class TurnSaver:
    """Engine thread (request_finished); the builder it hands over may run on the writer."""

    def __init__(
        self,
        store: KVSource,
        kv_cache: PagedKVCache,
        rope: RotaryEmbedding,
        staging_dtype: torch.dtype,
    ) -> None:
        self.store, self.kv_cache, self.rope = store, kv_cache, rope
        self.staging_dtype = staging_dtype  # the dtype the turn's rows wait in

    def save(
        self,
        request: Request,
        saved: StoredSession | None,
        reusable: int,
        rows: TurnRows,
        token_ids: list[int],
        block_table: list[int],
    ) -> None:
        """Hand the store the turn's tokens; for the chain it plans, a builder of the new
        chunks (`prepare`). What the device pool alone holds is copied then (its blocks are
        freed after request_finished); the builder touches only CPU tensors it owns, so it
        may run on another thread."""
        B = self.kv_cache.block_size
        n = min(len(token_ids), len(block_table) * B)
        if rows.num_rows():
            # The last sampled token is never fed back: its KV does not exist.
            n = min(n, 1 + rows.max_position())
        m = min(reusable, n) if saved is not None else 0
        ids = list(token_ids[:n])

        def prepare(plan: TurnPlan) -> tuple[ChunkBuilder, int]:
            return self._builder(plan, ids, m, rows, block_table)

        assert request.session_id is not None  # request_finished saves sessions only
        opened = OpenedTurn.of(request.store_turn)
        self.store.save_turn(
            request.tenant, request.session_id, ids, saved, m, prepare, request.arrival_time,
            opened,
        )  # fmt: skip

    def _builder(
        self, plan: TurnPlan, ids: list[int], m: int, rows: TurnRows, block_table: list[int]
    ) -> tuple[ChunkBuilder, int]:
        """The plan's new chunks from the turn's rows, the stored base chunks' and (tokens
        never seen computed) the device pool's, copied now; and the bytes they will hold."""
        spec, n, store = self.kv_cache.spec, len(ids), self.store
        spans = plan.new_spans()
        have = torch.zeros(n, dtype=torch.bool)
        have[:m] = True
        computed = rows.positions()
        have[computed[computed < n]] = True
        wanted = torch.zeros(n, dtype=torch.bool)
        for _, _, a, b in spans:
            wanted[a:b] = True
        missing = (wanted & ~have).nonzero().flatten()
        device_rows = self._copy_from_device(missing, block_table) if len(missing) else None
        dtype, storage = self.staging_dtype, store.storage_dtype

        def build() -> dict[ChunkKey, SessionKV | ChunkDelta]:
            try:
                out: dict[ChunkKey, SessionKV | ChunkDelta] = {}
                for _, key, a, b in spans:
                    base, keep = plan.bases.get(key, (None, 0))
                    first = a + keep  # rows before it are the stored base chunk's
                    kv = torch.empty(
                        (spec.num_layers, 2, b - first, spec.num_kv_heads, spec.head_dim),
                        dtype=dtype,
                    )
                    rows.scatter_into(kv, first, b)
                    if device_rows is not None:
                        inside = (missing >= first) & (missing < b)
                        if inside.any():
                            kv[:, :, missing[inside] - first] = device_rows[:, :, inside].to(dtype)
                    value = SessionKV(ids[first:b], kv_quant.convert(kv, storage))
                    out[key] = value if base is None else ChunkDelta(base, keep, value)
                return out
            finally:
                rows.release()

        new_tokens = sum(b - a - plan.bases.get(k, (None, 0))[1] for _, k, a, b in spans)
        nbytes = new_tokens * store.bytes_per_token + rows.nbytes()
        if not spans:
            rows.release()
        return build, nbytes

    def _copy_from_device(self, positions: torch.Tensor, block_table: list[int]) -> torch.Tensor:
        """Tokens the connector never saw computed (device prefix cache): un-rotated pool K and
        V, [L, 2, len(positions), Hkv, D] on the CPU."""
        cache = self.kv_cache
        slots = block_slots(block_table, positions, cache.block_size).to(cache.device)
        flat = (cache.num_blocks * cache.block_size, cache.spec.num_kv_heads, cache.spec.head_dim)
        dev_positions = positions.to(cache.device)
        out = torch.empty(
            (cache.spec.num_layers, 2, len(positions), *flat[1:]),
            dtype=self.staging_dtype,
        )
        for layer in range(cache.spec.num_layers):
            k = cache.k(layer).reshape(flat).index_select(0, slots)
            v = cache.v(layer).reshape(flat).index_select(0, slots)
            out[layer, 0] = unrope(k, dev_positions, self.rope).to("cpu", out.dtype)
            out[layer, 1] = v.to("cpu", out.dtype)
        return out


def block_slots(block_table: list[int], positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The pool slots of `positions` in a sequence with `block_table`."""
    table = torch.tensor(block_table, dtype=torch.long)
    return table[positions // block_size] * block_size + positions % block_size
