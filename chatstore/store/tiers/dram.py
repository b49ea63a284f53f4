"""Host DRAM tier: one preallocated pool of fixed-size blocks, pinned when CUDA is present.

    pool:      [N, L, 2, B, Hkv, W]   N blocks of B tokens, every layer's K (pre-RoPE) and V
                                      (W = D; int8 storage: D + 2, each row with its scale)
    by_layer:  [L, N, 2, B, Hkv, W]   the same memory as it is laid out: `pool` is a view of it

Layer-major storage, so that one layer of a run of consecutive blocks is one contiguous piece:
the layer loader copies it to the device as it is (one non-blocking copy from pinned memory per
layer per run), with no gather into pageable memory first. A block's accounting is unchanged
(`pool[b]` is block b, `block_bytes` of it).

A session of T tokens takes ceil(T / B) blocks from the free list (any blocks, in any order);
its block list and token ids live in a small table. Capacity is whole blocks, so
used_bytes = blocks in use x bytes per block. `get` copies each byte once into a fresh tensor;
`get_rows` does too, or with `read_in_place` (the default where the pool is pinned) answers
PooledRows (dram_rows.py): the blocks themselves, leased. A leased block that is deleted is
parked, not freed, until its last lease ends (it still counts as used); extending an entry
whose partial last block is leased is refused (the hierarchy stores the chunk whole instead).

Not thread-safe on its own: the hierarchy only calls it under its lock (`in_memory`). Leases
end on whichever thread drops the rows: the free list and the leases take a lock of their own.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from dataclasses import dataclass

import torch

from chatstore.store import kv_quant
from chatstore.store.session_kv import ChunkKey, SessionKV
from chatstore.store.tiers.base import MembershipListener, StorageTier, TierFull
from chatstore.store.tiers.dram_rows import PooledRows


@dataclass(frozen=True)
class TokenKVShape:
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
        self,
        capacity_bytes: int,
        layout: TokenKVShape,
        block_size: int = 16,
        pin: bool | None = None,
        read_in_place: bool | None = None,
    ) -> None:
        """read_in_place: get_rows answers leased PooledRows instead of a copy (None: where the
        pool is pinned, i.e. with CUDA; a CPU gains nothing from it by default)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.layout = layout
        self.block_size = block_size
        self.block_bytes = layout.bytes_per_token * block_size
        self.num_blocks = max(0, capacity_bytes // self.block_bytes)
        pin = torch.cuda.is_available() if pin is None else pin
        L, Hkv, W = layout.num_layers, layout.num_kv_heads, layout.row_width
        shape = (L, self.num_blocks, 2, block_size, Hkv, W)
        self.by_layer = torch.empty(shape, dtype=layout.dtype, pin_memory=pin)
        self.pool = self.by_layer.transpose(0, 1)  # [N, L, 2, B, Hkv, W], a view
        self.read_in_place = pin if read_in_place is None else read_in_place
        self._free: deque[int] = deque(range(self.num_blocks))
        self._entries: dict[ChunkKey, _Entry] = {}
        self._leases: Counter[int] = Counter()  # block -> PooledRows reading it
        self._parked: set[int] = set()  # deleted while leased: freed when the last lease ends
        self._lease_lock = threading.Lock()
        self._watchers: list[MembershipListener] = []

    def watch(self, listener: MembershipListener) -> bool:
        self._watchers.append(listener)
        return True

    def _tell(self, key: ChunkKey, held: bool) -> None:
        for watcher in self._watchers:
            watcher(key, held)

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
        if extra > len(self._free) + self._reusable(entry.blocks[kept_blocks:]):
            return False
        if keep % B and self._leases[entry.blocks[keep // B]]:
            return False  # rows past `keep` in that block are being read in place
        del self._entries[base]
        self._tell(base, False)
        self._give_back(entry.blocks[kept_blocks:])
        blocks = entry.blocks[:kept_blocks] + [self._free.popleft() for _ in range(extra)]
        kv = kv_quant.convert(rows.kv, self.layout.dtype)
        offset = keep % B
        head = min(B - offset, rows.num_tokens) if offset else 0
        if head:  # the rest of base's last, partial block
            self.pool[blocks[keep // B], :, :, offset : offset + head] = kv[:, :, :head]
        if rows.num_tokens > head:
            self._write_blocks(blocks[kept_blocks:], kv[:, :, head:])
        self._entries[key] = _Entry(blocks, entry.token_ids[:keep] + list(rows.token_ids))
        self._tell(key, True)
        return True

    def put(self, key: ChunkKey, value: SessionKV) -> None:
        n = self._blocks_for(value.num_tokens)
        old = self._entries.get(key)
        if n > len(self._free) + (self._reusable(old.blocks) if old else 0):
            raise TierFull(f"DRAM tier: {n} blocks needed, {len(self._free)} free")
        self.delete(key)
        blocks = [self._free.popleft() for _ in range(n)]
        self._write_blocks(blocks, kv_quant.convert(value.kv, self.layout.dtype))
        self._entries[key] = _Entry(blocks, list(value.token_ids))
        self._tell(key, True)

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
        blocks = entry.blocks[first : -(-end // B)]
        if self.read_in_place and end > start:
            return self._pooled_rows(entry.token_ids[start:end], blocks, start - first * B)
        kv = self._read_blocks(blocks, end - first * B)
        return SessionKV(entry.token_ids[start:end], kv[:, :, start - first * B :])

    def _pooled_rows(self, token_ids: list[int], blocks: list[int], offset: int) -> PooledRows:
        """The rows as leased pool blocks; `kv`, if anyone asks, is get_rows' copy."""
        T = offset + len(token_ids)
        with self._lease_lock:
            self._leases.update(blocks)
        return PooledRows(
            token_ids,
            self.by_layer,
            blocks,
            offset,
            lambda: self._read_blocks(blocks, T)[:, :, offset:],
            self._end_lease,
        )

    def _end_lease(self, blocks: list[int]) -> None:
        with self._lease_lock:
            for b in blocks:
                self._leases[b] -= 1
                if self._leases[b] == 0:
                    del self._leases[b]
                    if b in self._parked:
                        self._parked.discard(b)
                        self._free.append(b)

    def _give_back(self, blocks: list[int]) -> None:
        """Blocks a deleted entry held: free, or parked while some are read in place."""
        with self._lease_lock:
            for b in blocks:
                if self._leases[b]:
                    self._parked.add(b)
                else:
                    self._free.append(b)

    def _reusable(self, blocks: list[int]) -> int:
        """How many of these blocks a delete would free now (the others are being read)."""
        with self._lease_lock:
            return sum(1 for b in blocks if not self._leases[b])

    def leased_blocks(self) -> int:
        with self._lease_lock:
            return len(self._leases)

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
        self._give_back(entry.blocks)
        self._tell(key, False)
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
        with self._lease_lock:
            free, parked = set(self._free), set(self._parked)
            assert all(self._leases[b] for b in parked), "a parked DRAM block has no lease"
        assert len(set(used)) == len(used), "a DRAM block belongs to two sessions"
        assert not set(used) & free, "a DRAM block is both used and free"
        assert not parked & (free | set(used)), "a parked DRAM block is in use or free"
        assert len(used) + len(free) + len(parked) == self.num_blocks, "DRAM blocks leaked"


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    """(index, length) of each run of consecutive values: [5, 6, 7, 2, 3] -> [(0, 3), (3, 2)]."""
    runs: list[tuple[int, int]] = []
    for i, b in enumerate(ids):
        if runs and ids[i - 1] + 1 == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs
