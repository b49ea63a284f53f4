"""Long prompt chunks' bf16 attention on torch's CPU flash-attention kernel, where the CPU has AMX.

A new turn on top of pooled history is the store's main path, and at agent lengths (1K new tokens
over 4K of history) its attention is most of the step. On a CPU with AMX, torch's flash kernel
(`aten._scaled_dot_product_flash_attention_for_cpu`) computes bf16 QK^T and PV as AMX tile
products (oneDNN brgemm); our paged kernel (`csrc/paged_prefill_bf16.c`) computes them with
AVX512-BF16 dot products. Measured on an Intel Xeon with AMX, 2 threads, one layer, the paged
kernel's ms against this path's (gather included):

    new / history      9 q heads, 3 KV, D 64      32 q heads, 8 KV, D 128
    64 / 200           0.30 vs 0.40 (0.76x)       -
    64 / 4000          5.4 vs 2.7  (2.0x)         -
    128 / 4000        13.8 vs 8.7  (1.6x)         50.6 vs 31.4 (1.6x, 128 / 2000)
    1000 / 4000       78.5 vs 25.2 (3.1x)         223 vs 86    (2.6x, 512 / 2000)
    2048 / 0          38.2 vs 14.0 (2.7x)         253 vs 70    (3.6x, 2000 / 0)

(the default model's shape: `python bench/attention_kernels.py --dtype bfloat16 --quick
--threads 2`, its `agent_1000_on_4k` and `causal_2k`; the rest timed in process, the 64-token
rows as medians of 7 calls: a first timing of 64 / 4000 without them read 5.3 vs 9.0),
so a sequence with at least FLASH_MIN_QUERY new tokens takes this path, and one with at least 48
on 512+ tokens of context (`takes_flash`); shorter ones (decode tokens above all) stay on the
paged kernel. In fp32 the paged kernel is as fast (1000 / 4000: 73.6 vs
77.7 ms) and serves everything; CPUs without AMX keep it too (torch's kernel has no tile
products there: on an AMD EPYC with AVX512-BF16 it took 3.0-3.3x the paged kernel's time).

The sequence's K, V are gathered from its blocks (~2 MB per layer at 5K tokens), then attended in
two calls, because torch's causal mask is aligned top-left and the new rows sit at the end of the
context: the history without a mask, the new part causally, merged by their log-sum-exps. No K, V
copy per query head: for the history the G query heads of a KV head are one block of rows, for the
new part a stride-0 dimension of K, V.

What it gives up: bit-for-bit agreement with the paged kernel (decode items are the prefill
kernel's on one token, `docs/engine.md`). Rows computed here agree with it within bf16 rounding
(the probabilities are rounded to bf16 before PV in both); a prompt's rows may then differ in the
last bit according to how its prefill was chunked. `CHATSTORE_FLASH_PREFILL=0` keeps every row on
the paged kernel; `=1` takes this path on any CPU (tests, benchmarks).
"""

from __future__ import annotations

import os
from functools import cache

import torch

from chatstore.kernels.native import cpu_flags
from chatstore.kernels.paged_attention import gather_sequence_kv

# Which sequences run here: 128 new tokens or more, or 48 or more on 512+ tokens of context
# (medians of 7 calls, one layer of the default model: 48 new on 548 1.10x, 64 on 1,064 1.17x,
# 100 on 4K ~2.2x; below, the paged kernel wins: 64 on 264 0.76x, 32 on 1,032 0.83x).
FLASH_MIN_QUERY = 128
FLASH_MIN_QUERY_LONG_CONTEXT = 48
FLASH_LONG_CONTEXT = 512


def takes_flash(query_len: int, context_len: int) -> bool:
    """Whether a sequence with these new / total tokens is attended here (when enabled)."""
    return query_len >= FLASH_MIN_QUERY or (
        query_len >= FLASH_MIN_QUERY_LONG_CONTEXT and context_len >= FLASH_LONG_CONTEXT
    )


_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def flash_prefill_enabled(dtype: torch.dtype) -> bool:
    """Whether long bf16 prefill runs on torch's flash kernel (env CHATSTORE_FLASH_PREFILL)."""
    setting = os.environ.get("CHATSTORE_FLASH_PREFILL", "auto")
    if setting not in ("auto", "0", "1"):
        raise ValueError(f"CHATSTORE_FLASH_PREFILL must be auto, 0 or 1, got {setting!r}")
    if dtype != torch.bfloat16:
        return False
    return setting == "1" or (setting == "auto" and _cpu_has_amx())


@cache
def _cpu_has_amx() -> bool:
    return "amx_bf16" in cpu_flags()


def flash_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of q [S, Hq, D] over k, v [C, Hkv, D] (the last S of C are the queries),
    -> [S, Hq, D] in q's dtype."""
    new, num_heads, head_dim = q.shape
    context, num_kv_heads, _ = k.shape
    groups = num_heads // num_kv_heads
    history = context - new
    kh = k.permute(1, 0, 2).contiguous()  # [Hkv, C, D]: each head's keys in one run
    vh = v.permute(1, 0, 2).contiguous()
    qh = q.reshape(new, num_kv_heads, groups, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, S, D]
    # The new part, causally: the G query heads of a KV head share it through a stride-0 dim.
    k_new = kh[:, None, history:].expand(num_kv_heads, groups, new, head_dim)
    v_new = vh[:, None, history:].expand(num_kv_heads, groups, new, head_dim)
    out_new, lse_new = _flash(qh, k_new, v_new, 0.0, True, scale=scale)
    if history == 0:
        out = out_new
    else:
        # The history, unmasked: the G heads' rows are one [G * S] block of queries per KV head,
        # so each head's keys are packed once for all of them (~15% faster than G stride-0 heads).
        q_rows = qh.reshape(1, num_kv_heads, groups * new, head_dim)
        out_old, lse_old = _flash(
            q_rows, kh[None, :, :history], vh[None, :, :history], 0.0, False, scale=scale
        )
        out_old = out_old.view(num_kv_heads, groups, new, head_dim)
        lse_old = lse_old.view(num_kv_heads, groups, new)
        lse = torch.logaddexp(lse_old, lse_new)
        merged = out_old * torch.exp(lse_old - lse).unsqueeze(-1)
        merged += out_new * torch.exp(lse_new - lse).unsqueeze(-1)
        out = merged.to(q.dtype)
    return out.permute(2, 0, 1, 3).reshape(new, num_heads, head_dim)


def flash_prefill_sequence(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    q_start: int,
    query_len: int,
    context_len: int,
    scale: float,
    out: torch.Tensor,
) -> None:
    """One sequence's rows of a paged step (q, out [T, Hq, D]), its K, V read from its blocks."""
    k = gather_sequence_kv(k_cache, block_table, context_len)
    v = gather_sequence_kv(v_cache, block_table, context_len)
    rows = slice(q_start, q_start + query_len)
    out[rows] = flash_attend(q[rows], k, v, scale)
