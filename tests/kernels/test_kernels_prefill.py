"""The paged-prefill kernel (native C) against the gather-and-SDPA reference.

Ragged batches that mix fresh prompts, new tokens on top of pooled history and single decode
tokens; block sizes that do and do not divide the kernel's 16-key chunks; GQA groups; head dims
the kernel specialises (64, 128) and a generic one; every ISA variant this CPU runs; shuffled
block ids with NaN in every slot no sequence owns, so a read outside a sequence's blocks or past
a query's position shows up.
"""

from __future__ import annotations

import random

import pytest
import torch

from chatstore.kernels.native import native_library
from chatstore.kernels.paged_attention import paged_attention_reference
from chatstore.kernels.paged_decode import make_decode_plan, paged_decode_native
from chatstore.kernels.paged_prefill import make_prefill_plan, paged_prefill, paged_prefill_native

pytestmark = pytest.mark.skipif(native_library() is None, reason="no native kernels (no gcc?)")

# (query_len, context_len): decode rows, fresh prompts, history prefill, boundaries.
MIXED = [(1, 1), (7, 7), (1, 40), (5, 37), (33, 33), (16, 64), (1, 17), (40, 100)]


def _case(seqs, hq, hkv, head_dim, block, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    needed = [(c + block - 1) // block for _, c in seqs]
    num_blocks = 2 * sum(needed) + 5
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, start = [], 0
    for n in needed:
        tables.append(ids[start : start + n + 1])  # a spare trailing block, as the engine has
        start += n + 1
    shape = (num_blocks, block, hkv, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    for table, (_, ctx) in zip(tables, seqs, strict=True):
        for p in range(ctx):
            k_cache[table[p // block], p % block] = torch.randn(hkv, head_dim, generator=gen)
            v_cache[table[p // block], p % block] = torch.randn(hkv, head_dim, generator=gen)
    total = sum(q for q, _ in seqs)
    q = torch.randn(total, hq, head_dim, generator=gen)
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    return q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), padded


def _reference(q, k_cache, v_cache, tables, seqs, scale):
    return paged_attention_reference(
        q.float(),
        torch.nan_to_num(k_cache.float()),  # the reference gathers whole blocks: no NaN there
        torch.nan_to_num(v_cache.float()),
        tables,
        [n for n, _ in seqs],
        [c for _, c in seqs],
        scale,
    )


@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize("block", [4, 16, 24, 32])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_mixed_batch_matches_reference(hq, hkv, block, head_dim, variant_lib):
    q, k_cache, v_cache, tables = _case(MIXED, hq, hkv, head_dim, block, torch.float32, seed=block)
    plan = make_prefill_plan(tables, [n for n, _ in MIXED], [c for _, c in MIXED])
    out = paged_prefill_native(q, k_cache, v_cache, plan, head_dim**-0.5, variant_lib)
    ref = _reference(q, k_cache, v_cache, tables, MIXED, head_dim**-0.5)
    assert out.shape == q.shape and not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_long_history_prefill_matches_reference(variant_lib):
    seqs = [(100, 1100), (1, 700), (64, 64)]
    q, k_cache, v_cache, tables = _case(seqs, 9, 3, 64, 16, torch.float32, seed=5)
    plan = make_prefill_plan(tables, [n for n, _ in seqs], [c for _, c in seqs])
    out = paged_prefill_native(q, k_cache, v_cache, plan, 0.125, variant_lib)
    torch.testing.assert_close(out, _reference(q, k_cache, v_cache, tables, seqs, 0.125))


def test_bf16_matches_reference_within_bf16_resolution():
    q, k_cache, v_cache, tables = _case(MIXED, 9, 3, 64, 16, torch.bfloat16, seed=2)
    plan = make_prefill_plan(tables, [n for n, _ in MIXED], [c for _, c in MIXED])
    out = paged_prefill(q, k_cache, v_cache, plan, 0.125)
    assert out.dtype == torch.bfloat16
    ref = _reference(q, k_cache, v_cache, tables, MIXED, 0.125)
    # fp32 accumulation, the output rounded once (and, on an AVX512-BF16 CPU, where this runs the
    # bf16 dot-product path, P rounded to bf16 before PV): a few 2^-9 of the output's scale.
    torch.testing.assert_close(out.float(), ref, atol=4e-3, rtol=2**-7)


def test_head_dim_not_multiple_of_16_takes_the_reference_path():
    seqs = [(3, 10)]
    q, k_cache, v_cache, tables = _case(seqs, 4, 2, 8, 4, torch.float32)
    k_cache, v_cache = torch.nan_to_num(k_cache), torch.nan_to_num(v_cache)
    plan = make_prefill_plan(tables, [3], [10])
    out = paged_prefill(q, k_cache, v_cache, plan, 0.3)
    torch.testing.assert_close(out, _reference(q, k_cache, v_cache, tables, seqs, 0.3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q_read_in_place_from_the_fused_qkv_rows(dtype, variant_lib):
    """q as the runner hands it: the first Hq * D columns of the fused [T, (Hq + 2 Hkv) D]
    projection, rows apart by the whole width; read in place, it gives what a packed copy does."""
    hq, hkv, d = 9, 3, 64
    q, k_cache, v_cache, tables = _case(MIXED, hq, hkv, d, 16, dtype, seed=11)
    qkv = torch.randn(q.shape[0], (hq + 2 * hkv) * d).to(dtype)
    qkv[:, : hq * d] = q.reshape(q.shape[0], -1)
    strided = qkv[:, : hq * d].view(-1, hq, d)
    assert not strided.is_contiguous()
    plan = make_prefill_plan(tables, [n for n, _ in MIXED], [c for _, c in MIXED])
    got = paged_prefill_native(strided, k_cache, v_cache, plan, 0.125, variant_lib)
    want = paged_prefill_native(q.contiguous(), k_cache, v_cache, plan, 0.125, variant_lib)
    assert got.is_contiguous() and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_steps_single_tokens_take_the_decode_kernel(dtype):
    """The dispatcher: sequences with one new token (a mixed step's decodes) go to the decode
    kernel, which reads each K, V row once for all heads, the rest to the paged kernel; every row
    lands in its place, q read in place from the fused qkv rows."""
    hq, hkv, d = 9, 3, 64
    q, k_cache, v_cache, tables = _case(MIXED, hq, hkv, d, 16, dtype, seed=13)
    qkv = torch.randn(q.shape[0], (hq + 2 * hkv) * d).to(dtype)
    qkv[:, : hq * d] = q.reshape(q.shape[0], -1)
    strided = qkv[:, : hq * d].view(-1, hq, d)
    plan = make_prefill_plan(tables, [n for n, _ in MIXED], [c for _, c in MIXED])
    out = paged_prefill(strided, k_cache, v_cache, plan, 0.125)
    starts = plan.q_start.tolist()
    singles = [s for s, (n, _) in enumerate(MIXED) if n == 1]
    assert 0 < len(singles) < len(MIXED)
    rows = [starts[s] for s in singles]
    decode_plan = make_decode_plan(
        [tables[s].tolist() for s in singles], [MIXED[s][1] for s in singles], 16, q.device
    )
    decoded = paged_decode_native(q[rows], k_cache, v_cache, decode_plan, 0.125)
    assert decoded is not None and torch.equal(out[rows], decoded)
    others = [r for r in range(q.shape[0]) if r not in rows]
    paged = paged_prefill_native(q, k_cache, v_cache, plan, 0.125)
    assert torch.equal(out[others], paged[others])
    ref = _reference(q, k_cache, v_cache, tables, MIXED, 0.125)
    tol = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 4e-3, "rtol": 2**-7}
    torch.testing.assert_close(out.float(), ref, **tol)
