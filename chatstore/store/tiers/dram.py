"""Host DRAM tier: one preallocated pool of fixed-size blocks, pinned when CUDA is present.

    pool: [N, L, 2, B, Hkv, W]    N blocks of B tokens, every layer's K (pre-RoPE) and V
                                  (W = D; int8 storage: D + 2, each row with its scale)

A session of T tokens takes ceil(T / B) blocks from the free list (any blocks, in any order);
its block list and token ids live in a small table. Capacity is whole blocks, so
used_bytes = blocks in use x bytes per block. `get` copies each byte once into a fresh tensor.

Not thread-safe on its own: the hierarchy only calls it under its lock (`in_memory`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from chatstore.store import kv_quant
from chatstore.store.chunks.keys import ChunkKey
from chatstore.store.session_kv import SessionKV
from chatstore.store.tiers.base import StorageTier, TierFull


@dataclass(frozen=True)
class KVLayout:
    """The shape of one token's KV: what every tier's blocks and values are made of."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def row_width(self) -> int:
        """Elements of one stored (token, head) row: D, or for int8 D + its scale's bytes."""
        return kv_quant.row_width(self.head_dim, self.dtype)

    @property
    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.row_width * elem


@dataclass
class _Entry:
    blocks: list[int]
    token_ids: list[int]


class DramTier(StorageTier):
    name = "dram"
    in_memory = True

    def __init__(
        self, capacity_bytes: int, layout: KVLayout, block_size: int = 16, pin: bool | None = None
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.layout = layout
        self.block_size = block_size
        self.block_bytes = layout.bytes_per_token * block_size
        self.num_blocks = max(0, capacity_bytes // self.block_bytes)
        pin = torch.cuda.is_available() if pin is None else pin
        L, Hkv, W = layout.num_layers, layout.num_kv_heads, layout.row_width
        shape = (self.num_blocks, L, 2, block_size, Hkv, W)
        self.pool = torch.empty(shape, dtype=layout.dtype, pin_memory=pin)
        self._free: deque[int] = deque(range(self.num_blocks))
        self._entries: dict[ChunkKey, _Entry] = {}

    @property
    def capacity(self) -> int:
        return self.num_blocks * self.block_bytes

    def _blocks_for(self, num_tokens: int) -> int:
        return max(1, -(-num_tokens // self.block_size))

    def footprint(self, value: SessionKV) -> int:
        return self._blocks_for(value.num_tokens) * self.block_bytes

    def footprint_tokens(self, num_tokens: int) -> int:
        return self._blocks_for(num_tokens) * self.block_bytes

    def extend(self, base: ChunkKey, key: ChunkKey, keep: int, rows: SessionKV) -> bool:
        """key := the first `keep` tokens of base + rows, in base's blocks (base is gone
        afterwards): only `rows` are written. False (nothing changed) without room."""
        entry = self._entries.get(base)
        if entry is None or keep > len(entry.token_ids):
            return False
        B = self.block_size
        kept_blocks = -(-keep // B)
        total = keep + rows.num_tokens
        extra = self._blocks_for(total) - kept_blocks
        if extra > len(self._free) + len(entry.blocks) - kept_blocks:
            return False
        del self._entries[base]
        self._free.extend(entry.blocks[kept_blocks:])
        blocks = entry.blocks[:kept_blocks] + [self._free.popleft() for _ in range(extra)]
        kv = kv_quant.convert(rows.kv, self.layout.dtype)
        offset = keep % B
        head = min(B - offset, rows.num_tokens) if offset else 0
        if head:  # the rest of base's last, partial block
            self.pool[blocks[keep // B], :, :, offset : offset + head] = kv[:, :, :head]
        if rows.num_tokens > head:
            self._write_blocks(blocks[kept_blocks:], kv[:, :, head:])
        self._entries[key] = _Entry(blocks, entry.token_ids[:keep] + list(rows.token_ids))
        return True

    def put(self, key: ChunkKey, value: SessionKV) -> None:
        n = self._blocks_for(value.num_tokens)
        old = self._entries.get(key)
        if n > len(self._free) + (len(old.blocks) if old else 0):
            raise TierFull(f"DRAM tier: {n} blocks needed, {len(self._free)} free")
        self.delete(key)
        blocks = [self._free.popleft() for _ in range(n)]
        self._write_blocks(blocks, kv_quant.convert(value.kv, self.layout.dtype))
        self._entries[key] = _Entry(blocks, list(value.token_ids))

    def _write_blocks(self, blocks: list[int], kv: torch.Tensor) -> None:
        """kv [L, 2, T, H, W] into the pool's blocks: one strided copy of the full blocks, the
        last partial block zero-padded (no padded temporary of the whole value)."""
        T, B = kv.shape[2], self.block_size
        full = T // B
        if full:
            src = kv[:, :, : full * B].unflatten(2, (full, B)).permute(2, 0, 1, 3, 4, 5)
            self.pool[torch.tensor(blocks[:full])] = src
        rest = T - full * B
        if rest or not T:
            tail = self.pool[blocks[full]]  # [L, 2, B, H, W], a view
            tail[:, :, rest:].zero_()
            tail[:, :, :rest] = kv[:, :, full * B :]

    def get(self, key: ChunkKey) -> SessionKV | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        kv = self._read_blocks(entry.blocks, len(entry.token_ids))
        return SessionKV(list(entry.token_ids), kv)

    def get_rows(self, key: ChunkKey, start: int, end: int) -> SessionKV | None:
        """Rows [start, end) of key's value, reading only the blocks that hold them."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        end = min(end, len(entry.token_ids))
        B = self.block_size
        first = start // B
        kv = self._read_blocks(entry.blocks[first : -(-end // B)], end - first * B)
        return SessionKV(entry.token_ids[start:end], kv[:, :, start - first * B :])

    def _read_blocks(self, blocks: list[int], T: int) -> torch.Tensor:
        """The blocks' first T tokens as a fresh [L, 2, T, H, W] tensor, each byte copied once.

        A gather (index_select), a permute+reshape and a final `contiguous()` made three full
        copies (~45 ms for 1,000 tokens of the default model). Instead each run of consecutive
        block ids is one strided copy into a view of the output (a fresh session's blocks are
        usually one run), and the last, partial block copies only its live tokens."""
        L, H, W = self.layout.num_layers, self.layout.num_kv_heads, self.layout.row_width
        out = torch.empty((L, 2, T, H, W), dtype=self.layout.dtype)
        B, full = self.block_size, T // self.block_size
        for first, count in _runs(blocks[:full]):
            start = first * B
            dst = out[:, :, start : start + count * B].unflatten(2, (count, B))
            run = self.pool[blocks[first] : blocks[first] + count]  # [count, L, 2, B, H, W]
            dst.copy_(run.permute(1, 2, 0, 3, 4, 5))
        rest = T - full * B
        if rest:
            out[:, :, full * B :].copy_(self.pool[blocks[full], :, :, :rest])
        return out

    def delete(self, key: ChunkKey) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._free.extend(entry.blocks)
        return True

    def contains(self, key: ChunkKey) -> bool:
        return key in self._entries

    def used_bytes(self) -> int:
        return (self.num_blocks - len(self._free)) * self.block_bytes

    def keys(self) -> list[ChunkKey]:
        return list(self._entries)

    def size_of(self, key: ChunkKey) -> int:
        entry = self._entries.get(key)
        return len(entry.blocks) * self.block_bytes if entry else 0

    def token_ids(self, key: ChunkKey) -> list[int] | None:
        entry = self._entries.get(key)
        return list(entry.token_ids) if entry else None

    def check_integrity(self) -> None:
        used = [b for e in self._entries.values() for b in e.blocks]
        assert len(set(used)) == len(used), "a DRAM block belongs to two sessions"
        assert not set(used) & set(self._free), "a DRAM block is both used and free"
        assert len(used) + len(self._free) == self.num_blocks, "DRAM blocks leaked"


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    """(index, length) of each run of consecutive values: [5, 6, 7, 2, 3] -> [(0, 3), (3, 2)]."""
    runs: list[tuple[int, int]] = []
    for i, b in enumerate(ids):
        if runs and ids[i - 1] + 1 == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs
