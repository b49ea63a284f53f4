"""Decode attention (one new token per sequence) straight over the blocks of a paged KV cache.

Rather than padding every sequence's KV to the longest one, all blocks the batch uses are taken as
one flat list and attention runs per block, with a softmax segmented by owning sequence
(flash-decoding's split-K, with one split per block):

    flat block  b0  b1  b2 | b3 | b4  b5      owner[b] = sequence of block b
    owner        0   0   0 |  1 |  2   2      valid[b, s] = slot s of block b is < context_len

    m[i] = max over i's blocks of the block max;  p = exp(s - m[owner]);  out = sum(p V) / sum(p)

The per-step `DecodePlan` (index tensors) is built once and reused by every layer.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class DecodePlan(NamedTuple):
    flat_blocks: torch.Tensor  # [NB] physical block ids, sequence by sequence
    owner: torch.Tensor  # [NB] index of the sequence each flat block belongs to
    invalid: torch.Tensor  # [NB, 1, 1, B] True for slots past the sequence's context
    num_seqs: int


def make_decode_plan(
    block_tables: list[list[int]], context_lens: list[int], block_size: int, device: torch.device
) -> DecodePlan:
    flat: list[int] = []
    owner: list[int] = []
    fill: list[int] = []
    for i, (table, ctx) in enumerate(zip(block_tables, context_lens, strict=True)):
        n = (ctx + block_size - 1) // block_size
        flat.extend(table[:n])
        owner.extend([i] * n)
        fill.extend([block_size] * (n - 1) + [ctx - (n - 1) * block_size])
    slots = torch.arange(block_size, device=device)
    invalid = slots[None, :] >= torch.tensor(fill, device=device)[:, None]
    return DecodePlan(
        flat_blocks=torch.tensor(flat, dtype=torch.long, device=device),
        owner=torch.tensor(owner, dtype=torch.long, device=device),
        invalid=invalid[:, None, None, :],
        num_seqs=len(context_lens),
    )


def paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan, scale: float
) -> torch.Tensor:
    """q [S, Hq, D] (one token per sequence) -> [S, Hq, D]."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    k = k_cache.index_select(0, plan.flat_blocks).permute(0, 2, 3, 1)  # [NB, Hkv, D, B]
    v = v_cache.index_select(0, plan.flat_blocks).transpose(1, 2)  # [NB, Hkv, B, D]
    qb = (q * scale).view(num_seqs, num_kv_heads, group, head_dim).index_select(0, plan.owner)
    scores = torch.matmul(qb, k).float()  # [NB, Hkv, G, B]
    scores.masked_fill_(plan.invalid, float("-inf"))
    block_max = scores.amax(dim=-1)  # [NB, Hkv, G]
    seq_max = torch.full(
        (num_seqs, num_kv_heads, group), float("-inf"), dtype=scores.dtype, device=q.device
    )
    owner = plan.owner.view(-1, 1, 1).expand_as(block_max)
    seq_max.scatter_reduce_(0, owner, block_max, "amax")
    probs = torch.exp(scores - seq_max.index_select(0, plan.owner).unsqueeze(-1))
    denom = torch.zeros_like(seq_max).index_add_(0, plan.owner, probs.sum(dim=-1))
    block_out = torch.matmul(probs.to(v.dtype), v)  # [NB, Hkv, G, D]
    out = torch.zeros(
        (num_seqs, num_kv_heads, group, head_dim), dtype=block_out.dtype, device=q.device
    )
    out.index_add_(0, plan.owner, block_out)
    out = out / denom.unsqueeze(-1).to(out.dtype)
    return out.view(num_seqs, num_heads, head_dim).to(q.dtype)
