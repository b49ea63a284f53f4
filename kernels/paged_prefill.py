"""Causal attention of any batch of new tokens over a paged KV cache, read in place.

The general case of the step: fresh prompts, new turns on top of pooled history (the store's
main path) and single decode tokens, in one call. The native kernel
(`csrc/paged_prefill.c`, CPU, fp32/bf16) reads each sequence's K, V blocks where they lie, in
chunks of one block, with an online softmax; chunks past a tile's last position are never read,
so history prefill costs what its causal attention costs and no history is copied. bf16 on a CPU
with AVX512-BF16 runs `csrc/paged_prefill_bf16.c` (bf16 dot products for QK^T and PV, fp32
accumulation, the same online softmax); elsewhere bf16 is widened to fp32 on load. Elsewhere (no
compiler, CUDA, a head dim that is not a multiple of 16) the gather-and-SDPA reference runs.
Sequences with many new tokens take torch's flash kernel where that is faster (bf16 on a CPU with
AMX: `flash_prefill.py`); sequences with one new token (the decodes a mixed step carries) take the
decode kernel, which reads each K, V row once for all the sequence's heads where a prefill item
gives one token's G rows a whole item's lanes; the rest of the step stays on the paged kernel.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cached_property

import torch

from chatstore.kernels.flash_prefill import (
    flash_prefill_enabled,
    flash_prefill_sequence,
    takes_flash,
)
from chatstore.kernels.native import NATIVE_DTYPES, native_library, require_library
from chatstore.kernels.paged_attention import paged_attention_reference
from chatstore.kernels.paged_decode import DecodePlan, paged_decode_native


@dataclass(frozen=True)
class PrefillPlan:
    """Per-step sequence layout, built once and shared by every layer."""

    block_tables: torch.Tensor  # [S, W] int64, padded with 0
    q_start: torch.Tensor  # [S] int64: first row of each sequence in q
    query_lens: torch.Tensor  # [S] int64
    context_lens: torch.Tensor  # [S] int64
    query_len_list: list[int]
    context_len_list: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.query_len_list)

    @cached_property
    def long_seqs(self) -> list[int]:
        """The sequences torch's flash kernel would attend (`flash_prefill.takes_flash`)."""
        lens = zip(self.query_len_list, self.context_len_list, strict=True)
        return [s for s, (n, c) in enumerate(lens) if takes_flash(n, c)]

    @cached_property
    def single_token_seqs(self) -> list[int]:
        """Sequences with one new token (a mixed step's decodes): the decode kernel's part."""
        return [s for s, n in enumerate(self.query_len_list) if n == 1]

    @cached_property
    def _single_token_index(self) -> torch.Tensor:
        return torch.tensor(self.single_token_seqs, dtype=torch.long, device=self.q_start.device)

    @cached_property
    def single_token_rows(self) -> torch.Tensor:
        """The q rows of `single_token_seqs`, in their order."""
        return self.q_start.index_select(0, self._single_token_index)

    @cached_property
    def _single_token_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        index = self._single_token_index
        return self.block_tables.index_select(0, index), self.context_lens.index_select(0, index)

    def single_token_plan(self, block_size: int) -> DecodePlan:
        """`single_token_seqs` as the decode kernel's plan (its tables made once per step)."""
        return DecodePlan(*self._single_token_layout, block_size)

    @cached_property
    def _subsets(self) -> dict[frozenset[int], PrefillPlan]:
        return {}

    def without(self, dropped: frozenset[int]) -> PrefillPlan:
        """This plan less the sequences `dropped` (made once per step, every layer reuses it);
        its rows keep their places in the step's q."""
        if dropped not in self._subsets:
            keep = [s for s in range(self.num_seqs) if s not in dropped]
            index = torch.tensor(keep, dtype=torch.long, device=self.q_start.device)
            self._subsets[dropped] = PrefillPlan(
                block_tables=self.block_tables.index_select(0, index),
                q_start=self.q_start.index_select(0, index),
                query_lens=self.query_lens.index_select(0, index),
                context_lens=self.context_lens.index_select(0, index),
                query_len_list=[self.query_len_list[s] for s in keep],
                context_len_list=[self.context_len_list[s] for s in keep],
            )
        return self._subsets[dropped]


def make_prefill_plan(
    block_tables: torch.Tensor, query_lens: list[int], context_lens: list[int]
) -> PrefillPlan:
    starts, total = [], 0
    for n in query_lens:
        starts.append(total)
        total += n
    device = block_tables.device
    return PrefillPlan(
        block_tables=block_tables.to(torch.long).contiguous(),
        q_start=torch.tensor(starts, dtype=torch.long, device=device),
        query_lens=torch.tensor(query_lens, dtype=torch.long, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.long, device=device),
        query_len_list=list(query_lens),
        context_len_list=list(context_lens),
    )


def native_prefill_supported(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether the native kernel serves a model of this dtype, device and head size."""
    return (
        device.type == "cpu"
        and dtype in NATIVE_DTYPES
        and head_dim % 16 == 0
        and native_library() is not None
    )


def native_prefill_applies(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (
        native_prefill_supported(q.dtype, q.device, q.shape[-1])
        and k_cache.dtype == q.dtype == v_cache.dtype
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )


def paged_prefill(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: PrefillPlan, scale: float
) -> torch.Tensor:
    """q [T, Hq, D] (the step's new tokens, their K, V already in the pool) -> [T, Hq, D]."""
    if native_prefill_applies(q, k_cache, v_cache):
        long_seqs = plan.long_seqs if flash_prefill_enabled(q.dtype) else []
        singles = plan.single_token_seqs
        if not long_seqs and len(singles) in (0, plan.num_seqs):
            return paged_prefill_native(q, k_cache, v_cache, plan, scale)
        out = torch.empty(q.shape, dtype=q.dtype)
        dropped = set(long_seqs)
        if singles and len(singles) < plan.num_seqs:
            rows = plan.single_token_rows
            decoded = paged_decode_native(
                q.index_select(0, rows), k_cache, v_cache,
                plan.single_token_plan(k_cache.shape[1]), scale,
            )  # fmt: skip
            assert decoded is not None  # the native library is there (native_prefill_applies)
            out.index_copy_(0, rows, decoded)
            dropped |= set(singles)
        rest = plan.without(frozenset(dropped))
        if rest.num_seqs:
            paged_prefill_native(q, k_cache, v_cache, rest, scale, out=out)
        starts = plan.q_start.tolist()
        for s in long_seqs:
            flash_prefill_sequence(
                q,
                k_cache,
                v_cache,
                plan.block_tables[s],
                starts[s],
                plan.query_len_list[s],
                plan.context_len_list[s],
                scale,
                out,
            )
        return out
    return paged_attention_reference(
        q,
        k_cache,
        v_cache,
        plan.block_tables,
        plan.query_len_list,
        plan.context_len_list,
        scale,
    )


def paged_prefill_native(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PrefillPlan,
    scale: float,
    lib: ctypes.CDLL | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`lib`: a particular build (native.fallback_library() for the fp32 path); default: this
    CPU's. `out` [T, Hq, D] packed: where the plan's rows are written (others left as they are)."""
    lib = require_library(lib)
    _, num_heads, head_dim = q.shape
    if q.stride(2) != 1 or q.stride(1) != head_dim:  # token rows may be apart: read in place
        q = q.contiguous()
    _, block_size, num_kv_heads, _ = k_cache.shape
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype)  # [T, Hq, D], packed
    tables = plan.block_tables
    rc = lib.paged_prefill(
        NATIVE_DTYPES[q.dtype],
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        tables.shape[1],
        plan.q_start.data_ptr(),
        plan.query_lens.data_ptr(),
        plan.context_lens.data_ptr(),
        plan.num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        scale,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise MemoryError("paged_prefill: cannot allocate the kernel's scratch buffers")
    return out
