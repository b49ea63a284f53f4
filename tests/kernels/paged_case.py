"""A random paged KV pool with ragged sequences, for the attention kernels' tests.

Every slot no sequence owns (unused blocks, and the slots past a sequence's context in its last
block) holds NaN, so a kernel that reads outside a sequence's context shows it in its output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chatstore.kernels.paged_attention import paged_attention_reference


@dataclass
class PagedCase:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [N, B, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [S, W] int64, padded with block 0
    query_lens: list[int]
    context_lens: list[int]

    @property
    def scale(self) -> float:
        return self.q.shape[-1] ** -0.5

    def reference(self) -> torch.Tensor:
        """fp32 attention over the same (dtype-rounded) values: [T, Hq, D]."""
        return paged_attention_reference(
            self.q.float(),
            self.k_cache.float(),
            self.v_cache.float(),
            self.block_tables,
            self.query_lens,
            self.context_lens,
            self.scale,
        )

    @property
    def max_abs_v(self) -> float:
        return float(self.v_cache.float().nan_to_num(0.0).abs().max())


def paged_case(
    query_lens: list[int],
    context_lens: list[int],
    heads: tuple[int, int] = (6, 2),
    head_dim: int = 32,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedCase:
    """Sequences whose blocks are scattered over the pool in random order (two spare blocks)."""
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(seed)
    needed = [(c + block_size - 1) // block_size for c in context_lens]
    num_blocks = sum(needed) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    tables = []
    for n, ctx in zip(needed, context_lens, strict=True):
        table = [order.pop() for _ in range(n)]
        tables.append(table)
        flat = (len(table) * block_size, num_kv_heads, head_dim)
        for cache in (k_cache, v_cache):
            rows = torch.full(flat, float("nan"))
            rows[:ctx] = torch.randn((ctx, num_kv_heads, head_dim), generator=gen)
            cache[table] = rows.view(len(table), block_size, num_kv_heads, head_dim).to(dtype)
    width = max(needed)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn((sum(query_lens), num_heads, head_dim), generator=gen).to(dtype)
    return PagedCase(q, k_cache, v_cache, block_tables, list(query_lens), list(context_lens))
