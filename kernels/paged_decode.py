"""Decode attention (one new token per sequence) straight over the blocks of a paged KV cache.

Two implementations of the same function:

- native (CPU, fp32/bf16): `csrc/paged_decode.c`, one OpenMP work item per (sequence, KV head)
  that reads each K and V row of the sequence's blocks in place, once, for its whole GQA group.
  bf16 on a CPU with AVX512-BF16 runs `csrc/paged_decode_bf16.c` (bf16 dot products, fp32
  accumulation, the bf16 prefill kernel's arithmetic to the bit, so a token's output does not
  depend on whether a step decodes it or runs it in paged prefill); elsewhere bf16 is widened to
  fp32 on load (see native.py).
- torch (any device, the fallback): all blocks the batch uses are taken as one flat list and
  attention runs per block, with a softmax segmented by owning sequence (flash-decoding's split-K,
  with one split per block):

    flat block  b0  b1  b2 | b3 | b4  b5      owner[b] = sequence of block b
    owner        0   0   0 |  1 |  2   2      invalid[b, s] = slot s of block b is >= context_len

    m[i] = max over i's blocks of the block max;  p = exp(s - m[owner]);  out = sum(p V) / sum(p)

The per-step `DecodePlan` is built once and reused by every layer.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch

from chatstore.kernels.native import NATIVE_DTYPES, native_library


class BlockSegments(NamedTuple):
    flat_blocks: torch.Tensor  # [NB] physical block ids, sequence by sequence
    owner: torch.Tensor  # [NB] index of the sequence each flat block belongs to
    invalid: torch.Tensor  # [NB, 1, 1, B] True for slots past the sequence's context


@dataclass(frozen=True)
class DecodePlan:
    block_tables: torch.Tensor  # [S, W] int64, padded with 0
    context_lens: torch.Tensor  # [S] int64
    block_size: int

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @cached_property
    def segments(self) -> BlockSegments:
        """Index tensors of the torch path, made on first use."""
        bs, device = self.block_size, self.context_lens.device
        num_blocks = (self.context_lens + bs - 1) // bs  # [S]
        used = torch.arange(self.block_tables.shape[1], device=device) < num_blocks[:, None]
        owner = torch.repeat_interleave(torch.arange(self.num_seqs, device=device), num_blocks)
        # Position of each flat block inside its sequence, then the slots it holds.
        first = torch.cumsum(num_blocks, 0) - num_blocks
        index = torch.arange(owner.shape[0], device=device) - first[owner]
        fill = (self.context_lens[owner] - index * bs).clamp(max=bs)
        invalid = torch.arange(bs, device=device)[None, :] >= fill[:, None]
        return BlockSegments(self.block_tables[used], owner, invalid[:, None, None, :])


def make_decode_plan(
    block_tables: list[list[int]], context_lens: list[int], block_size: int, device: torch.device
) -> DecodePlan:
    width = max(len(t) for t in block_tables)
    tables = [t + [0] * (width - len(t)) for t in block_tables]
    return DecodePlan(
        block_tables=torch.tensor(tables, dtype=torch.long, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.long, device=device),
        block_size=block_size,
    )


def paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan, scale: float
) -> torch.Tensor:
    """q [S, Hq, D] (one token per sequence) -> [S, Hq, D]."""
    if _native_applies(q, k_cache, v_cache):
        out = paged_decode_native(q, k_cache, v_cache, plan, scale)
        if out is not None:
            return out
    return paged_decode_torch(q, k_cache, v_cache, plan, scale)


def _native_applies(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (
        q.device.type == "cpu"
        and q.dtype in NATIVE_DTYPES
        and k_cache.dtype == q.dtype == v_cache.dtype
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and native_library() is not None
    )


def paged_decode_native(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor | None:
    """The C kernel over the blocks in place; None when it is not available.

    `lib`: a particular build (native.fallback_library() for the fp32 path); default: this CPU's."""
    lib = lib or native_library()
    if lib is None:
        return None
    q = q.contiguous()
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    tables, ctx = plan.block_tables, plan.context_lens
    out = torch.empty_like(q)
    rc = lib.paged_decode(
        NATIVE_DTYPES[q.dtype],
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        tables.shape[1],
        ctx.data_ptr(),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        scale,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise MemoryError("paged_decode: cannot allocate the kernel's scratch buffers")
    return out


def paged_decode_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan, scale: float
) -> torch.Tensor:
    """The portable path: segmented softmax over the flat list of the batch's blocks."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    flat_blocks, owner, invalid = plan.segments
    k = k_cache.index_select(0, flat_blocks).permute(0, 2, 3, 1)  # [NB, Hkv, D, B]
    v = v_cache.index_select(0, flat_blocks).transpose(1, 2)  # [NB, Hkv, B, D]
    qb = (q * scale).view(num_seqs, num_kv_heads, group, head_dim).index_select(0, owner)
    scores = torch.matmul(qb, k).float()  # [NB, Hkv, G, B]
    scores.masked_fill_(invalid, float("-inf"))
    block_max = scores.amax(dim=-1)  # [NB, Hkv, G]
    seq_max = torch.full(
        (num_seqs, num_kv_heads, group), float("-inf"), dtype=scores.dtype, device=q.device
    )
    seq_max.scatter_reduce_(0, owner.view(-1, 1, 1).expand_as(block_max), block_max, "amax")
    probs = torch.exp(scores - seq_max.index_select(0, owner).unsqueeze(-1))
    denom = torch.zeros_like(seq_max).index_add_(0, owner, probs.sum(dim=-1))
    block_out = torch.matmul(probs.to(v.dtype), v)  # [NB, Hkv, G, D]
    out = torch.zeros(
        (num_seqs, num_kv_heads, group, head_dim), dtype=block_out.dtype, device=q.device
    )
    out.index_add_(0, owner, block_out)
    out = out / denom.unsqueeze(-1).to(out.dtype)
    return out.view(num_seqs, num_heads, head_dim).to(q.dtype)
