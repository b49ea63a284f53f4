"""The fast decode kernels (native C and torch) against the reference paged attention.

Tiny random shapes; context lengths around block boundaries; GQA groups; block tables whose
physical ids are shuffled and non-contiguous, with unrelated garbage in every other block.
"""

from __future__ import annotations

import random

import pytest
import torch

from chatstore.kernels.native import native_library
from chatstore.kernels.paged_attention import attend, paged_attention_reference
from chatstore.kernels.paged_decode import (
    make_decode_plan,
    paged_decode,
    paged_decode_native,
    paged_decode_torch,
)

BLOCK = 16
CONTEXTS = [1, 15, 16, 17, 100]
HEADS = [(4, 4), (4, 2), (6, 2), (9, 3)]  # (query heads, KV heads): MHA and GQA groups 2, 3


def _case(
    context_lens: list[int], hq: int, hkv: int, dtype: torch.dtype, seed: int = 0, head_dim: int = 8
):
    """q, k_cache, v_cache, block tables (lists) over a pool with shuffled block ids."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    needed = [(c + BLOCK - 1) // BLOCK for c in context_lens]
    num_blocks = 2 * sum(needed) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, start = [], 0
    for n in needed:
        # Spare trailing entries, as a sequence that reserved blocks for tokens to come has.
        tables.append(ids[start : start + n + 1])
        start += n + 1
    shape = (num_blocks, BLOCK, hkv, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(len(context_lens), hq, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables


def _reference(q, k_cache, v_cache, tables, context_lens, scale):
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    return paged_attention_reference(
        q.float(),
        k_cache.float(),
        v_cache.float(),
        padded,
        [1] * len(context_lens),
        context_lens,
        scale,
    )


def _native_or_skip():
    if native_library() is None:
        pytest.skip("native kernels unavailable (no gcc?)")


IMPLS = {"torch": paged_decode_torch, "native": paged_decode_native, "dispatch": paged_decode}


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize(("hq", "hkv"), HEADS)
@pytest.mark.parametrize("context", CONTEXTS)
def test_single_sequence_matches_reference(impl, hq, hkv, context):
    if impl == "native":
        _native_or_skip()
    q, k_cache, v_cache, tables = _case([context], hq, hkv, torch.float32, seed=context + hq)
    plan = make_decode_plan(tables, [context], BLOCK, torch.device("cpu"))
    out = IMPLS[impl](q, k_cache, v_cache, plan, 0.3)
    ref = _reference(q, k_cache, v_cache, tables, [context], 0.3)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize(("hq", "hkv"), HEADS)
@pytest.mark.parametrize("head_dim", [8, 64, 128])  # 64 and 128 have their own native copies
def test_mixed_batch_matches_reference(impl, hq, hkv, head_dim):
    if impl == "native":
        _native_or_skip()
    contexts = [17, 1, 100, 16, 15, 33, 64]
    q, k_cache, v_cache, tables = _case(contexts, hq, hkv, torch.float32, hq * hkv, head_dim)
    plan = make_decode_plan(tables, contexts, BLOCK, torch.device("cpu"))
    out = IMPLS[impl](q, k_cache, v_cache, plan, 64**-0.5)
    ref = _reference(q, k_cache, v_cache, tables, contexts, 64**-0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_native_bf16_matches_reference():
    _native_or_skip()
    contexts = [1, 16, 17, 100]
    q, k_cache, v_cache, tables = _case(contexts, 6, 2, torch.bfloat16, seed=7, head_dim=64)
    plan = make_decode_plan(tables, contexts, BLOCK, torch.device("cpu"))
    out = paged_decode_native(q, k_cache, v_cache, plan, 0.35)
    ref = _reference(q, k_cache, v_cache, tables, contexts, 0.35)
    assert out.dtype == torch.bfloat16
    # fp32 accumulation, the output rounded once (and, on an AVX512-BF16 CPU, where this runs the
    # bf16 dot-product path, P rounded to bf16 before PV): a few 2^-9 of the output's scale.
    torch.testing.assert_close(out.float(), ref, atol=4e-3, rtol=2**-7)


@pytest.mark.parametrize(("hq", "hkv"), HEADS)
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_every_isa_variant_matches_reference(hq, hkv, head_dim, variant_lib):
    contexts = [17, 1, 100, 16, 15, 33, 64]
    q, k_cache, v_cache, tables = _case(contexts, hq, hkv, torch.float32, hq * hkv, head_dim)
    plan = make_decode_plan(tables, contexts, BLOCK, torch.device("cpu"))
    out = paged_decode_native(q, k_cache, v_cache, plan, 64**-0.5, variant_lib)
    ref = _reference(q, k_cache, v_cache, tables, contexts, 64**-0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_native_reads_only_the_sequence_blocks():
    """NaN in every block no sequence owns (and past each context) changes nothing."""
    _native_or_skip()
    contexts = [17, 5]
    q, k_cache, v_cache, tables = _case(contexts, 4, 2, torch.float32, seed=3)
    ref = _reference(q, k_cache, v_cache, tables, contexts, 0.5)
    owned = {
        (t[p // BLOCK], p % BLOCK) for t, c in zip(tables, contexts, strict=True) for p in range(c)
    }
    for b in range(k_cache.shape[0]):
        for s in range(BLOCK):
            if (b, s) not in owned:
                k_cache[b, s] = float("nan")
                v_cache[b, s] = float("nan")
    plan = make_decode_plan(tables, contexts, BLOCK, torch.device("cpu"))
    out = paged_decode_native(q, k_cache, v_cache, plan, 0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("context", [1, 7, 40])
def test_attend_matches_repeated_heads(context):
    """The 4-D GQA SDPA of `attend` equals plain attention with KV heads repeated."""
    gen = torch.Generator().manual_seed(context)
    k = torch.randn(context, 2, 8, generator=gen)
    v = torch.randn(context, 2, 8, generator=gen)
    for query_len in {1, context // 2 or 1, context}:
        q = torch.randn(query_len, 6, 8, generator=gen)
        kh, vh = k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, kh) * 0.4
        q_pos = torch.arange(context - query_len, context)[:, None]
        scores.masked_fill_(torch.arange(context)[None, :] > q_pos, float("-inf"))
        ref = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vh)
        torch.testing.assert_close(attend(q, k, v, 0.4), ref, atol=1e-5, rtol=1e-5)
