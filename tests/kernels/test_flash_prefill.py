"""Long prefill chunks on torch's flash kernel (kernels/flash_prefill.py), against an fp32
reference on the same bf16 inputs, and inside a paged step beside the paged kernel's sequences.

Torch's flash kernel runs on every CPU; only the automatic choice of it needs AMX, so the path is
forced on with CHATSTORE_FLASH_PREFILL=1 here and tested everywhere. Tolerances as
test_kernels_bf16.py (outputs rounded to bf16, probabilities rounded to bf16 before PV); they hold
with the merge of the history and new parts too, each part's output rounded to bf16 before it.
"""

from __future__ import annotations

import pytest
import torch

from chatstore.kernels.flash_prefill import (
    FLASH_LONG_CONTEXT,
    FLASH_MIN_QUERY,
    FLASH_MIN_QUERY_LONG_CONTEXT,
    flash_attend,
    flash_prefill_enabled,
    takes_flash,
)
from chatstore.kernels.native import cpu_flags, native_library
from chatstore.kernels.paged_attention import attend
from chatstore.kernels.paged_prefill import make_prefill_plan, paged_prefill, paged_prefill_native
from tests.kernels.paged_case import paged_case

ATOL, RTOL = 4e-3, 2**-7
BLOCK = 16


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(out.float(), ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 64), (8, 2, 128)])
@pytest.mark.parametrize(("new", "history"), [(130, 0), (200, 37), (150, 1000)])
def test_flash_attend_matches_fp32_reference(heads, kv_heads, head_dim, new, history):
    g = torch.Generator().manual_seed(new * 7 + history)
    q = torch.randn(new, heads, head_dim, generator=g).bfloat16()
    k = torch.randn(new + history, kv_heads, head_dim, generator=g).bfloat16()
    v = torch.randn(new + history, kv_heads, head_dim, generator=g).bfloat16()
    scale = head_dim**-0.5
    out = flash_attend(q, k, v, scale)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    _close(out, attend(q.float(), k.float(), v.float(), scale))


def _paged_step(query_lens: list[int], context_lens: list[int], seed: int):
    """A bf16 step over a pool whose blocks are shuffled between the sequences (paged_case: the
    slots no sequence owns hold NaN, so reading past a context shows)."""
    case = paged_case(
        query_lens, context_lens, heads=(9, 3), head_dim=64, dtype=torch.bfloat16, seed=seed
    )
    plan = make_prefill_plan(case.block_tables, query_lens, context_lens)
    return case, plan


@pytest.mark.skipif(native_library() is None, reason="no native kernels (no gcc?)")
def test_long_sequences_take_flash_and_the_rest_stay_bitwise_on_the_paged_kernel(monkeypatch):
    monkeypatch.setenv("CHATSTORE_FLASH_PREFILL", "1")
    # long: 300 new; 128 new (nothing before); 60 new on 600 of context. Short: a decode token,
    # 5 fresh tokens, 127 new on 400, 60 new on 300.
    query_lens = [1, 300, 5, FLASH_MIN_QUERY, FLASH_MIN_QUERY - 1, 60, 60]
    context_lens = [40, 700, 5, FLASH_MIN_QUERY, 400, 600, 300]
    case, plan = _paged_step(query_lens, context_lens, seed=1)
    assert plan.long_seqs == [1, 3, 5]
    q, k_cache, v_cache, scale = case.q, case.k_cache, case.v_cache, case.scale
    out = paged_prefill(q, k_cache, v_cache, plan, scale)
    paged = paged_prefill_native(q, k_cache, v_cache, plan, scale)
    _close(out, case.reference())
    start = 0
    for s, n in enumerate(query_lens):
        rows = slice(start, start + n)
        if s not in plan.long_seqs:  # untouched by the split: the paged kernel's very bits
            assert torch.equal(out[rows], paged[rows]), s
        start += n


@pytest.mark.skipif(native_library() is None, reason="no native kernels (no gcc?)")
def test_flash_off_keeps_every_row_on_the_paged_kernel(monkeypatch):
    monkeypatch.setenv("CHATSTORE_FLASH_PREFILL", "0")
    case, plan = _paged_step([300, 2], [900, 60], seed=2)
    assert plan.long_seqs == [0]
    out = paged_prefill(case.q, case.k_cache, case.v_cache, plan, case.scale)
    paged = paged_prefill_native(case.q, case.k_cache, case.v_cache, plan, case.scale)
    assert torch.equal(out, paged)


def test_which_sequences_take_flash():
    assert takes_flash(FLASH_MIN_QUERY, FLASH_MIN_QUERY)  # a fresh prompt of 128
    assert not takes_flash(FLASH_MIN_QUERY - 1, FLASH_LONG_CONTEXT - 1)
    assert takes_flash(FLASH_MIN_QUERY_LONG_CONTEXT, FLASH_LONG_CONTEXT)
    assert not takes_flash(FLASH_MIN_QUERY_LONG_CONTEXT - 1, 100_000)
    assert not takes_flash(1, 100_000)  # decode tokens stay on the paged kernel


def test_the_choice(monkeypatch):
    monkeypatch.delenv("CHATSTORE_FLASH_PREFILL", raising=False)
    assert not flash_prefill_enabled(torch.float32)  # the paged kernel is as fast in fp32
    assert flash_prefill_enabled(torch.bfloat16) == ("amx_bf16" in cpu_flags())
    monkeypatch.setenv("CHATSTORE_FLASH_PREFILL", "1")
    assert flash_prefill_enabled(torch.bfloat16)
    assert not flash_prefill_enabled(torch.float32)
    monkeypatch.setenv("CHATSTORE_FLASH_PREFILL", "yes")
    for dtype in (torch.bfloat16, torch.float32):  # said at start whatever the dtype
        with pytest.raises(ValueError, match="CHATSTORE_FLASH_PREFILL"):
            flash_prefill_enabled(dtype)


def test_the_start_up_line_says_the_choice_and_refuses_a_bad_setting(monkeypatch):
    from chatstore.engine.cpu_paths import describe_cpu_paths

    monkeypatch.setenv("CHATSTORE_FLASH_PREFILL", "1")
    line = describe_cpu_paths(torch.bfloat16)
    assert "long prefill attention torch flash from 128 new tokens (48 on 512+" in line
    assert "long prefill attention paged kernel" in describe_cpu_paths(torch.float32)
    monkeypatch.setenv("CHATSTORE_FLASH_PREFILL", "on")
    with pytest.raises(ValueError, match="CHATSTORE_FLASH_PREFILL must be auto, 0 or 1"):
        describe_cpu_paths(torch.float32)
