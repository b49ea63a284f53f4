"""Triton's unified paged attention (interpreted on CPU tensors) against the torch reference.

Tolerances, from what each dtype's kernel rounds (the reference runs in fp32 over the same,
already rounded q, K, V, so only the kernel's own rounding counts; |v| <= max|v| bounds |out|):

- fp32: both sum in fp32 and differ in order only (tiles of 16-32 keys with an online softmax
  vs one softmax). 1e-5 is ~20 fp32 ulps of outputs up to ~4.5; measured <= 5e-7.
- bf16 / fp16: the kernel rounds the softmax weights P to the dtype before the PV product (as
  flash attention does; relative error <= eps/2 per weight, so <= eps/2 * max|v| on the convex
  combination, once more through the normaliser) and the output once (eps/2 * |out|): in all
  <= 2 * eps * max|v| with eps = 2^-7 (bf16), 2^-10 (fp16). Measured: bf16 3.6e-3, fp16 6e-4
  at max|v| ~4.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from chatstore.kernels.triton.split_kv import SPLIT_SEGMENTS, choose_segments
from chatstore.kernels.triton.unified_attention import (
    make_attention_meta,
    unified_attention,
)
from tests.kernels.paged_case import PagedCase, paged_case

DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# A mixed step: a fresh prompt, a new turn on pooled history, two decodes (one at a block
# boundary), a prompt that is exactly one block plus one.
MIXED_QUERY = [5, 9, 1, 1, 17]
MIXED_CONTEXT = [5, 40, 33, 16, 17]


def tolerance(case: PagedCase) -> float:
    if case.q.dtype == torch.float32:
        return 1e-5
    return 2 * torch.finfo(case.q.dtype).eps * case.max_abs_v


def check(case: PagedCase, segments: int | None = None) -> torch.Tensor:
    meta = make_attention_meta(case.block_tables, case.query_lens, case.context_lens)
    out = unified_attention(case.q, case.k_cache, case.v_cache, meta, case.scale, segments)
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    assert not out.isnan().any(), "read a slot outside some sequence's context"
    err = (out.float() - case.reference()).abs().max().item()
    assert err <= tolerance(case), err
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_batch(dtype: torch.dtype, block_size: int) -> None:
    check(paged_case(MIXED_QUERY, MIXED_CONTEXT, block_size=block_size, dtype=dtype))


@pytest.mark.parametrize(
    ("heads", "head_dim"),
    [((4, 4), 32), ((8, 1), 16), ((9, 3), 64), ((32, 8), 16)],
    ids=["mha", "mqa-group8", "smollm2-group3", "llama1b-group4"],
)
def test_gqa_groups(heads: tuple[int, int], head_dim: int) -> None:
    """Groups of 1, 3 (16 rows a program hold 5 tokens x 3 heads, one row spare), 4 and 8."""
    check(paged_case([3, 1, 6], [3, 20, 38], heads=heads, head_dim=head_dim, seed=1))


def test_ragged_many_sequences() -> None:
    """Many short sequences: the binary search over query_start and the spare programs."""
    query = [1, 2, 1, 7, 1, 3, 1, 1, 4, 2]
    context = [1, 2, 30, 7, 65, 19, 2, 48, 4, 34]
    check(paged_case(query, context, seed=2))


def test_causal_within_new_tokens_only() -> None:
    """New tokens see the whole history and the new tokens before them, none after."""
    case = paged_case([6], [6], heads=(2, 2), head_dim=16, seed=3)
    out = check(case)
    # Changing the last token's K and V changes only the last row.
    last = case.block_tables[0, 0]
    case.k_cache[last, 5] += 1.0
    case.v_cache[last, 5] += 1.0
    again = check(case)
    assert torch.equal(out[:5], again[:5])
    assert not torch.equal(out[5], again[5])


def test_q_may_be_a_view_of_the_fused_projection() -> None:
    """The runner hands q as a strided view of qkv [T, (Hq + 2 Hkv) D]."""
    case = paged_case(MIXED_QUERY, MIXED_CONTEXT, seed=4)
    tokens, heads, dim = case.q.shape
    qkv = torch.randn(tokens, (heads + 4) * dim)
    qkv[:, : heads * dim] = case.q.reshape(tokens, -1)
    case.q = qkv[:, : heads * dim].view(tokens, heads, dim)
    assert not case.q.is_contiguous()
    check(case)


@pytest.mark.parametrize(
    ("dtype", "block_size"),
    [(torch.float32, 16), (torch.bfloat16, 32), (torch.float16, 16), (torch.float32, 32)],
)
def test_split_kv_decode(dtype: torch.dtype, block_size: int) -> None:
    """Long decode contexts over 4 segments; one context shorter than a segment's share leaves
    segments that see no key (m = -inf), which the reduce must weigh as zero."""
    case = paged_case(
        [1, 1, 1], [300, 9, 129], block_size=block_size, dtype=dtype, seed=5 + block_size
    )
    split = check(case, segments=4)
    whole = check(case, segments=1)
    assert (split.float() - whole.float()).abs().max().item() <= tolerance(case)


def test_split_kv_chosen_for_long_decode() -> None:
    """The default picks split-KV for a decode step of few long sequences (and then the reduce
    runs); not for prefill, short contexts, or a grid that already fills a GPU."""
    assert choose_segments(1, 600, 2 * 3) == SPLIT_SEGMENTS
    assert choose_segments(2, 600, 2 * 3) == 1
    assert choose_segments(1, 100, 2 * 3) == 1
    assert choose_segments(1, 600, 64 * 8) == 1
    check(paged_case([1, 1], [520, 40], heads=(4, 2), head_dim=16, seed=6))


def test_split_kv_over_prefill_rows() -> None:
    """Segments also work for q-blocks with many rows: an early row's causal limit leaves later
    slices with no visible key for it."""
    check(paged_case([12, 1], [60, 50], seed=7), segments=4)


def test_lengths_are_read_on_the_device() -> None:
    """One launch shape (T, S) serves any lengths that fit it: what a CUDA graph replays. The
    same q, pool and grid with different context lengths in the device tensors give the
    reference's answer for those lengths."""
    case = paged_case([1, 1, 1], [40, 70, 20], seed=8)
    meta = make_attention_meta(case.block_tables, case.query_lens, case.context_lens)
    unified_attention(case.q, case.k_cache, case.v_cache, meta, case.scale, segments=1)
    meta.seq_lens.copy_(torch.tensor([39, 70, 17], dtype=torch.int32))
    out = unified_attention(case.q, case.k_cache, case.v_cache, meta, case.scale, segments=1)
    case.context_lens = [39, 70, 17]
    assert (out - case.reference()).abs().max().item() <= 1e-5
