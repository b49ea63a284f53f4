"""Reference attention over a paged KV cache (any device).

Queries of all sequences in a step are flattened, like vLLM's varlen layout:

    q:        [T, Hq, D]      T = sum(query_lens)
    k_cache:  [N, B, Hkv, D]  N blocks of B slots for one layer
    seq i owns slots block_tables[i][j] * B + o; its last query_lens[i] tokens are the new ones.

    context  0 1 2 3 4 5 6 7          query token t (0-based among the new ones) sees
    new                 ^ ^ ^         context positions 0 .. context_len - query_len + t
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_sequence_kv(
    cache: torch.Tensor, block_table: torch.Tensor, context_len: int
) -> torch.Tensor:
    """One sequence's first `context_len` slots as a contiguous [context_len, Hkv, D] tensor."""
    block_size = cache.shape[1]
    num_blocks = (context_len + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table[:num_blocks])  # [nb, B, Hkv, D]
    return blocks.flatten(0, 1)[:context_len]


def causal_offset_mask(query_len: int, context_len: int, device: torch.device) -> torch.Tensor:
    """Boolean [query_len, context_len]: True where the query may attend."""
    q_pos = torch.arange(context_len - query_len, context_len, device=device)[:, None]
    k_pos = torch.arange(context_len, device=device)[None, :]
    return k_pos <= q_pos


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal GQA attention of q [S, Hq, D] over k, v [C, Hkv, D]; the last S of C are queries.

    Inputs go to SDPA as 4-D [1, H, S, D] with `enable_gqa`: on CPU that selects the fused
    flash kernel (3-D inputs fall back to the math path, ~4x slower at 2K tokens) and the KV
    heads are not copied per query head.
    """
    query_len, context_len = q.shape[0], k.shape[0]
    qh = q.transpose(0, 1)[None]  # [1, Hq, S, D]
    kh = k.transpose(0, 1)[None]  # [1, Hkv, C, D]
    vh = v.transpose(0, 1)[None]
    gqa = q.shape[1] != k.shape[1]
    if query_len == 1:
        out = F.scaled_dot_product_attention(qh, kh, vh, scale=scale, enable_gqa=gqa)
    elif query_len == context_len:
        out = F.scaled_dot_product_attention(
            qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa
        )
    else:
        mask = causal_offset_mask(query_len, context_len, q.device)
        out = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa
        )
    return out[0].transpose(0, 1)  # [S, Hq, D]


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: list[int],
    context_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Attention for every sequence in the step; returns [T, Hq, D]."""
    out = torch.empty_like(q)
    start = 0
    for i, (query_len, context_len) in enumerate(zip(query_lens, context_lens, strict=True)):
        k = gather_sequence_kv(k_cache, block_tables[i], context_len)
        v = gather_sequence_kv(v_cache, block_tables[i], context_len)
        out[start : start + query_len] = attend(q[start : start + query_len], k, v, scale)
        start += query_len
    return out
