"""bf16 kernels on every ISA variant this machine can run (native.runnable_variants(): the
AVX512-BF16 dot-product path where the CPU has it, and the fp32 path of the avx512, avx2 and
generic builds, what CPUs without it run). Each is compared with an fp32 reference on the same
bf16 inputs.

Tolerances: the inputs are exact in both, products are exact in fp32 and sums are fp32, so what
differs from the reference is the output's rounding to bf16 (half an ulp, 2^-9 relative) and, in
the dot-product path, the probabilities rounded to bf16 before PV (as bf16 flash attention
does), which moves an output by a few 2^-9 of its scale at most: atol 4e-3, rtol 2^-7.
"""

from __future__ import annotations

import random

import pytest
import torch

from chatstore.kernels import native
from chatstore.kernels.fused_ops import NativeOps, TorchOps
from chatstore.kernels.native import (
    cpu_has_avx512_bf16,
    fallback_library,
    kernel_features,
    native_library,
    runnable_variants,
    variant_library,
)
from chatstore.kernels.paged_attention import paged_attention_reference
from chatstore.kernels.paged_decode import make_decode_plan, paged_decode_native
from chatstore.kernels.paged_prefill import make_prefill_plan, paged_prefill_native

pytestmark = pytest.mark.skipif(native_library() is None, reason="no native kernels (no gcc?)")

ATOL, RTOL = 4e-3, 2**-7


def test_this_cpu_computes_bf16_with_dot_products():
    if not cpu_has_avx512_bf16():
        pytest.skip(
            "this CPU lacks AVX512-BF16: bf16 runs the fp32 path here, which the fallback "
            "build's tests below cover"
        )
    assert kernel_features(native_library()).bf16_dot


def test_only_the_avx512_bf16_variant_has_the_dot_path():
    for variant in runnable_variants():
        lib = variant_library(variant.name)
        if lib is None:
            pytest.skip(f"the {variant.name} build is not available with this compiler")
        assert kernel_features(lib).bf16_dot == (variant.name == "avx512_bf16"), variant


def test_bf16_dot_env_off_serves_the_fallback(monkeypatch):
    if fallback_library() is None:
        pytest.skip("no variant without the dot-product path builds here")
    monkeypatch.setenv("CHATSTORE_BF16_DOT", "0")
    assert not kernel_features(native_library()).bf16_dot


def test_dot_path_is_not_served_where_the_os_does_not_report_avx512_bf16(monkeypatch):
    flags = native.cpu_flags()
    if "avx512_bf16" not in flags:
        pytest.skip("this CPU has no dot-product path to rule out")
    monkeypatch.setattr(native, "cpu_flags", lambda: flags - {"avx512_bf16"})
    assert native.selected_variant().name == "avx512"
    assert not kernel_features(native_library()).bf16_dot


def _paged(seqs, hkv, head_dim, block, seed):
    """bf16 k_cache, v_cache with NaN in every slot no sequence owns, and the block tables."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    needed = [(c + block - 1) // block for c in seqs]
    num_blocks = 2 * sum(needed) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, start = [], 0
    for n in needed:
        tables.append(ids[start : start + n + 1])
        start += n + 1
    shape = (num_blocks, block, hkv, head_dim)
    k_cache = torch.randn(shape, generator=gen).bfloat16()
    v_cache = torch.randn(shape, generator=gen).bfloat16()
    owned = torch.zeros(num_blocks * block, dtype=torch.bool)
    for table, ctx in zip(tables, seqs, strict=True):
        slots = torch.tensor(table)[torch.arange(ctx) // block] * block + torch.arange(ctx) % block
        owned[slots] = True
    for cache in (k_cache, v_cache):
        cache.view(-1, hkv, head_dim)[~owned] = float("nan")
    width = max(len(t) for t in tables)
    return k_cache, v_cache, torch.tensor([t + [0] * (width - len(t)) for t in tables])


def _reference(q, k_cache, v_cache, tables, query_lens, contexts, scale):
    return paged_attention_reference(
        q.float(),
        torch.nan_to_num(k_cache.float()),
        torch.nan_to_num(v_cache.float()),
        tables,
        query_lens,
        contexts,
        scale,
    )


@pytest.mark.parametrize(("hq", "hkv"), [(9, 3), (4, 4)])
@pytest.mark.parametrize("head_dim", [16, 64, 80, 128])
@pytest.mark.parametrize("block", [16, 6, 5])  # 5: odd, the decode kernel's fp32 path
def test_decode_bf16_matches_reference(variant_lib, hq, hkv, head_dim, block):
    contexts = [1, 2, 15, 16, 17, 33, 100]  # odd and even, block boundaries
    k_cache, v_cache, tables = _paged(contexts, hkv, head_dim, block, seed=head_dim + block)
    q = torch.randn(len(contexts), hq, head_dim, generator=torch.Generator().manual_seed(1))
    q = q.bfloat16()
    plan = make_decode_plan([t.tolist() for t in tables], contexts, block, torch.device("cpu"))
    scale = head_dim**-0.5
    # Enough sequences for whole-sequence work items, and few enough for per-head ones.
    threads = torch.get_num_threads()
    for items_threads in (1, 4):
        torch.set_num_threads(items_threads)
        try:
            out = paged_decode_native(q, k_cache, v_cache, plan, scale, variant_lib)
        finally:
            torch.set_num_threads(threads)
        ref = _reference(q, k_cache, v_cache, tables, [1] * len(contexts), contexts, scale)
        assert out.dtype == torch.bfloat16 and not out.isnan().any()
        torch.testing.assert_close(out.float(), ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(("hq", "hkv"), [(9, 3), (4, 4)])
@pytest.mark.parametrize("head_dim", [16, 64, 80, 128])
@pytest.mark.parametrize("block", [16, 24, 5])
def test_prefill_bf16_matches_reference(variant_lib, hq, hkv, head_dim, block):
    # (new tokens, context): fresh prompts, history, single decode rows; odd chunk lengths.
    seqs = [(1, 1), (7, 7), (5, 37), (33, 33), (1, 17), (40, 100)]
    contexts = [c for _, c in seqs]
    k_cache, v_cache, tables = _paged(contexts, hkv, head_dim, block, seed=head_dim * block)
    total = sum(n for n, _ in seqs)
    q = torch.randn(total, hq, head_dim, generator=torch.Generator().manual_seed(2)).bfloat16()
    plan = make_prefill_plan(tables, [n for n, _ in seqs], contexts)
    scale = head_dim**-0.5
    out = paged_prefill_native(q, k_cache, v_cache, plan, scale, variant_lib)
    ref = _reference(q, k_cache, v_cache, tables, [n for n, _ in seqs], contexts, scale)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    torch.testing.assert_close(out.float(), ref, atol=ATOL, rtol=RTOL)


def test_dot_product_path_is_the_one_this_cpu_runs():
    """On an AVX512-BF16 CPU this CPU's build and the fallback give different roundings (P in
    bf16 before PV), both within tolerance of the reference: the dot-product path did run."""
    if not kernel_features(native_library()).bf16_dot:
        pytest.skip("this CPU's build has no bf16 dot-product path (no AVX512-BF16)")
    seqs = [(64, 64), (1, 200)]
    contexts = [c for _, c in seqs]
    k_cache, v_cache, tables = _paged(contexts, 3, 64, 16, seed=9)
    q = torch.randn(65, 9, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    plan = make_prefill_plan(tables, [64, 1], contexts)
    fast = paged_prefill_native(q, k_cache, v_cache, plan, 0.125, native_library())
    slow = paged_prefill_native(q, k_cache, v_cache, plan, 0.125, fallback_library())
    assert not torch.equal(fast, slow)
    torch.testing.assert_close(fast.float(), slow.float(), atol=ATOL, rtol=RTOL)


def _close_to_torch(a: torch.Tensor, b: torch.Tensor) -> None:
    # Same roundings as torch's op-by-op bf16; a last-bit flip where rsqrt/exp differ by an ulp.
    torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=8e-3)


@pytest.mark.parametrize("width", [576, 100])  # 100: not a multiple of the 32-wide dot product
def test_fused_ops_bf16_match_torch(variant_lib, width):
    gen = torch.Generator().manual_seed(width)
    ops = NativeOps(variant_lib)
    h = torch.randn(40, width, generator=gen).bfloat16()
    delta = torch.randn(40, width, generator=gen).bfloat16()
    w = torch.randn(width, generator=gen).bfloat16()
    _close_to_torch(ops.rms_norm(h, w, 1e-6), TorchOps.rms_norm(h, w, 1e-6))
    h_native, h_torch = h.clone(), h.clone()
    out = ops.add_rms_norm(h_native, delta, w, 1e-6)
    ref = TorchOps.add_rms_norm(h_torch, delta, w, 1e-6)
    assert torch.equal(h_native, h_torch)  # the residual add rounds exactly like torch's
    _close_to_torch(out, ref)
    gate_up = (4 * torch.randn(40, 2 * width, generator=gen)).bfloat16()
    _close_to_torch(ops.silu_mul(gate_up), TorchOps.silu_mul(gate_up))
    # RoPE + KV write: 9 query heads, 3 KV heads, head dim 64.
    qkv = torch.randn(13, 15 * 64, generator=gen).bfloat16()
    angles = torch.rand(13, 32, generator=gen) * 50
    cos, sin = (
        torch.cat((angles, angles), -1).cos().bfloat16(),
        torch.cat((angles, angles), -1).sin().bfloat16(),
    )
    slots = torch.randperm(13 * 2, generator=gen)[:13]
    caches = [torch.zeros(13, 2, 3, 64, dtype=torch.bfloat16) for _ in range(4)]
    q_ref, k_ref, _ = TorchOps.rope_store_kv(
        qkv.clone(), cos, sin, slots, caches[0], caches[1], 9, 3
    )
    q, k, _ = ops.rope_store_kv(qkv, cos, sin, slots, caches[2], caches[3], 9, 3)
    _close_to_torch(q, q_ref)
    _close_to_torch(k, k_ref)
    assert torch.equal(caches[3], caches[1])


def test_bf16_rounding_keeps_denormals_and_nan(variant_lib):
    """The vectorised fp32 -> bf16 rounding of the fused ops equals torch's on the edge values
    (a hardware conversion would flush the denormals)."""
    edges = torch.tensor([1e-39, -3e-40, float("nan"), float("inf"), -0.0, 3.0e38, 1.00390625])
    special = edges.repeat(10)  # 70 wide: through the vector loop, not only its scalar tail
    h = torch.zeros(1, special.numel(), dtype=torch.bfloat16)
    delta = special.bfloat16()[None]
    ops = NativeOps(variant_lib)
    ops.add_rms_norm(h, delta, torch.ones(special.numel(), dtype=torch.bfloat16), 1e-6)
    ref = torch.zeros_like(h).add_(delta)
    assert torch.equal(h.isnan(), ref.isnan())  # NaN payloads differ within torch itself
    bits, ref_bits = h.view(torch.int16), ref.view(torch.int16)
    assert torch.equal(bits[~h.isnan()], ref_bits[~ref.isnan()])


@pytest.mark.parametrize(("hq", "hkv"), [(9, 3), (4, 4), (32, 4), (40, 5), (48, 1)])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("block", [16, 6, 5])
def test_decode_and_prefill_bf16_agree_bitwise(variant_lib, hq, hkv, head_dim, block):
    """A token's attention must not depend on the batch it runs in: continuous batching runs a
    decode token in the decode kernel in one step and, in a mixed step, in the prefill kernel
    (as the last new token of its sequence, or alone, in any lane of a work item).

    Bitwise on the AVX512-BF16 variant, which serves bf16 where `dtype = auto` picks it: there
    the decode item is the prefill item on one token (paged_decode_bf16.c). The fp32-path
    variants (avx512, avx2, generic: CPUs without AVX512-BF16, where `auto` serves fp32 and bf16
    runs only when asked for) compute decode with a two-pass softmax over whole rows and prefill
    with an online softmax over chunks: the same attention in another summation order, so there
    the two agree within the bf16 tolerance, not to the bit (docs/engine.md, "Batching
    invariance"). Within one kernel the result never depends on the work split."""
    bitwise = kernel_features(variant_lib).bf16_dot
    contexts = [1, 2, 15, 16, 17, 33, 100, 37]
    k_cache, v_cache, tables = _paged(contexts, hkv, head_dim, block, seed=head_dim + 7 * block)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(len(contexts), hq, head_dim, generator=gen).bfloat16()
    scale = head_dim**-0.5
    plan = make_decode_plan([t.tolist() for t in tables], contexts, block, torch.device("cpu"))
    threads = torch.get_num_threads()
    decoded = []
    for items_threads in (1, 4):  # whole-sequence and per-head work items
        torch.set_num_threads(items_threads)
        try:
            decoded.append(paged_decode_native(q, k_cache, v_cache, plan, scale, variant_lib))
        finally:
            torch.set_num_threads(threads)
    assert torch.equal(decoded[0], decoded[1])
    # The same queries in prefill steps: alone (q_len 1) and as the last of q_len new tokens.
    for extra in (0, 1, 3, 8):
        query_lens = [min(c, 1 + extra) for c in contexts]
        rows, last = [], []
        for s, n in enumerate(query_lens):
            rows.append(torch.randn(n - 1, hq, head_dim, generator=gen).bfloat16())
            rows.append(q[s : s + 1])
            last.append(sum(query_lens[: s + 1]) - 1)
        plan_p = make_prefill_plan(tables, query_lens, contexts)
        out = paged_prefill_native(torch.cat(rows), k_cache, v_cache, plan_p, scale, variant_lib)
        if bitwise:
            assert torch.equal(out[last], decoded[0]), f"{extra} extra new tokens per sequence"
        else:
            torch.testing.assert_close(out[last].float(), decoded[0].float(), atol=ATOL, rtol=RTOL)
