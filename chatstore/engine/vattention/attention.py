"""Attention over slot-contiguous KV with stock SDPA: no block table, no gather.

GQA without copying K/V: the G = Hq / Hkv query heads that share a KV head are folded into the
query-length axis, so SDPA sees Hkv heads of G*n queries each against [Hkv, ctx, D] keys:

    q [n, Hq, D] -> [1, Hkv, G*n, D]     row g*n + i is query head kv*G + g at new token i

Decode (every sequence one new token): the live slots lo..hi-1 form one strided view
[S, M*B, Hkv, D]; SDPA runs over [S, Hkv, G, Lmax] with a length mask. Slots in the range that
are not in the batch get a zero query that sees key 0 only; their rows are dropped.

Prefill, prefill on pooled history, and mixed batches: per sequence. A fresh prompt (start 0)
uses SDPA's is_causal with enable_gqa (its top-left alignment is right when the queries start
at key 0, whatever padding follows; the kernel skips the blocks above the diagonal). Queries on
history, at positions start..start+n-1, take an explicit causal mask offset by `start`
(top-left alignment is wrong when the history makes Lk > Lq) with the heads folded as above.

Batch invariance: the CPU flash kernel's result for a query row depends on how many keys it is
given, even masked ones, unless that count is a multiple of KEY_ALIGN (then it is the same bits
whatever the batch, the chunking or the padding; measured in bf16 and fp32). So every call reads
keys up to a multiple of KEY_ALIGN, and always as a 4-D call (3-D inputs take another kernel).
Keys past a sequence's length are masked: stale KV of the slot's last owner, or zeros (reading
a page never committed maps the shared zero page, which holds no memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from chatstore.engine.forward_batch import ForwardBatch
from chatstore.engine.vattention.kv_cache import VirtualKVCache

KEY_ALIGN = 16


def _aligned(n: int, limit: int) -> int:
    return min(-(-n // KEY_ALIGN) * KEY_ALIGN, limit)


@dataclass(frozen=True)
class DecodeSlots:
    lo: int
    hi: int
    rows: torch.Tensor | None  # [T] slot - lo of each batch row; None: rows are lo..hi-1
    mask: torch.Tensor  # [S, 1, 1, Lk] bool, True = attend
    keys: int  # Lk


@dataclass(frozen=True)
class PrefillSeq:
    row: int  # first row of the sequence's queries in the batch
    n: int
    slot: int
    keys: int  # Lk
    mask: torch.Tensor | None  # [G*n, Lk] bool on history; None: a fresh prompt, is_causal


@dataclass(frozen=True)
class SlotPlan:
    slots: list[int]  # each sequence's slot, batch order
    decode: DecodeSlots | None
    prefill: list[PrefillSeq]


def make_slot_plan(batch: ForwardBatch, cache: VirtualKVCache, groups: int) -> SlotPlan:
    slots = [cache.slot_of(table[0]) for table in batch.block_table_lists]
    if batch.is_decode:
        return SlotPlan(slots, _decode_slots(slots, batch.context_lens, cache.slot_tokens), [])
    seqs, row = [], 0
    for s, n, ctx in zip(slots, batch.query_lens, batch.context_lens, strict=True):
        start, keys = ctx - n, _aligned(ctx, cache.slot_tokens)
        mask = None
        if start:
            causal = torch.arange(keys)[None, :] <= start + torch.arange(n)[:, None]  # [n, Lk]
            mask = causal.repeat(groups, 1)
        seqs.append(PrefillSeq(row, n, s, keys, mask))
        row += n
    return SlotPlan(slots, None, seqs)


def _decode_slots(slots: list[int], context_lens: list[int], limit: int) -> DecodeSlots:
    lo, hi = min(slots), max(slots) + 1
    lens = torch.ones(hi - lo, dtype=torch.long)  # idle slots in the range see key 0
    for s, ctx in zip(slots, context_lens, strict=True):
        lens[s - lo] = ctx
    keys = _aligned(max(context_lens), limit)
    mask = (torch.arange(keys)[None, :] < lens[:, None])[:, None, None, :]
    in_order = slots == list(range(lo, hi))
    rows = None if in_order else torch.tensor([s - lo for s in slots], dtype=torch.long)
    return DecodeSlots(lo, hi, rows, mask, keys)


def slot_attention(
    q: torch.Tensor, cache: VirtualKVCache, layer: int, plan: SlotPlan, scale: float
) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D] over the KV already written into the slots."""
    if plan.decode is not None:
        return _decode(q, cache, layer, plan.decode, scale)
    out = torch.empty_like(q)
    for seq in plan.prefill:
        rows = slice(seq.row, seq.row + seq.n)
        out[rows] = _prefill(q[rows], cache, layer, seq, scale)
    return out


def _decode(
    q: torch.Tensor, cache: VirtualKVCache, layer: int, d: DecodeSlots, scale: float
) -> torch.Tensor:
    _, hq, dim = q.shape
    hkv = cache.spec.num_kv_heads
    k = cache.slots_view(layer, 0, d.lo, d.hi)[:, : d.keys].transpose(1, 2)  # [S, Hkv, Lk, D]
    v = cache.slots_view(layer, 1, d.lo, d.hi)[:, : d.keys].transpose(1, 2)
    qs = q
    if d.rows is not None:
        qs = q.new_zeros((d.hi - d.lo, hq, dim))
        qs[d.rows] = q
    out = F.scaled_dot_product_attention(
        qs.view(-1, hkv, hq // hkv, dim), k, v, attn_mask=d.mask, scale=scale
    )  # [S, Hkv, G, D]
    out = out.reshape(-1, hq, dim)
    return out if d.rows is None else out[d.rows]


def _prefill(
    q: torch.Tensor, cache: VirtualKVCache, layer: int, seq: PrefillSeq, scale: float
) -> torch.Tensor:
    n, hq, dim = q.shape
    hkv = cache.spec.num_kv_heads
    g, keys = hq // hkv, seq.keys
    k = cache.slots_view(layer, 0, seq.slot, seq.slot + 1)[:, :keys].transpose(1, 2)
    v = cache.slots_view(layer, 1, seq.slot, seq.slot + 1)[:, :keys].transpose(1, 2)
    if seq.mask is None:  # [1, Hq, n, D] against [1, Hkv, Lk, D]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k, v, is_causal=True, scale=scale, enable_gqa=g > 1
        )
        return out[0].transpose(0, 1)
    qf = q.view(n, hkv, g, dim).permute(1, 2, 0, 3).reshape(1, hkv, g * n, dim)
    out = F.scaled_dot_product_attention(qf, k, v, attn_mask=seq.mask, scale=scale)
    return out.view(hkv, g, n, dim).permute(2, 0, 1, 3).reshape(n, hq, dim)
