"""Quantized weights expanded just in time into one reusable buffer (`csrc/weight_dequant.c`).

A projection over many tokens (prefill) runs fastest as a blocked 16-bit GEMM; keeping a 16-bit
copy of every quantized weight for it costs 2-4x the quantized bytes. Instead the weight is
expanded for the call into a `DequantScratch` that every projection of a runner shares (they run
one at a time), then multiplied:

    int4pack_dequant(packed, scales_zeros, group, out)   torch's int4 pack -> W^T [K, N]
    int4_native_dequant(w, out)                           int4_matmul's Int4Packed -> W [N, K]
    int4pack_rows / int4_native_rows                      rows of either: an embedding lookup
    int8_dequant(q, scales, out)                          int8 + a scale a row -> W [N, K]

torch's int4 pack is not one layout: it depends on the kernel ATen dispatches to on this CPU
(AVX512: blocks of 64 rows, AVX2: 32, the generic kernel: byte pairs). `int4pack_layout()` packs a
probe once and matches it against the candidates, so a torch that changes its layout makes the
probe fail (None: the caller keeps its other path) rather than expand wrong weights.
"""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import torch

from chatstore.kernels.int4_matmul import Int4Packed
from chatstore.kernels.native import NATIVE_DTYPES, native_library, require_library


class Int4PackLayout(NamedTuple):
    """How `_convert_weight_to_int4pack_for_cpu` lays rows out (see csrc/weight_dequant.c)."""

    block_n: int  # rows per block; the last block may be shorter
    halves: bool  # a full block's byte j: rows j and j + block_n / 2 (else rows 2j and 2j + 1)


_CANDIDATES = (
    Int4PackLayout(64, True),
    Int4PackLayout(32, True),
    Int4PackLayout(32, False),
    Int4PackLayout(64, False),
    Int4PackLayout(16, False),
)


def unpack_int4pack(packed: torch.Tensor, n: int, k: int, layout: Int4PackLayout) -> torch.Tensor:
    """The codes [N, K] of a torch int4 pack under `layout` (the reference the probe and the
    tests read the pack with)."""
    flat = packed.reshape(-1)
    codes = torch.empty(n, k, dtype=torch.uint8)
    for n0 in range(0, n, layout.block_n):
        nb = min(layout.block_n, n - n0)
        rows = flat[n0 * k // 2 : (n0 + nb) * k // 2].reshape(k, nb // 2)
        low, high = (rows & 0x0F).t(), (rows >> 4).t()
        if layout.halves and nb == layout.block_n:
            codes[n0 : n0 + nb // 2], codes[n0 + nb // 2 : n0 + nb] = low, high
        else:
            codes[n0 : n0 + nb : 2], codes[n0 + 1 : n0 + nb : 2] = low, high
    return codes


@functools.cache
def int4pack_layout() -> Int4PackLayout | None:
    """torch's int4 pack layout on this CPU, or None when no candidate reproduces the probe (or
    torch lacks the op). 176 rows: two full blocks of 64 (five of 32) and a partial one."""
    op = getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None)
    if op is None:
        return None
    n, k = 176, 64
    codes = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(0))
    packed = op(codes.to(torch.int32), 2)
    for layout in _CANDIDATES:
        if torch.equal(unpack_int4pack(packed, n, k, layout), codes.to(torch.uint8)):
            return layout
    return None


def dequant_available() -> bool:
    """Whether weights can be expanded here: the native kernels load and torch's pack is known."""
    return native_library() is not None and int4pack_layout() is not None


class DequantScratch:
    """One buffer that every expanded weight of a runner lands in, grown to the largest; the
    projections run one at a time, so a view is valid until the next projection's call. `int8`:
    this runner's int4 projections multiply prompts with integer dot products instead
    (int4_vnni.py: they read the 4-bit weight as it is, so nothing of theirs lands here)."""

    def __init__(self, dtype: torch.dtype, int8: bool = False) -> None:
        if dtype not in NATIVE_DTYPES:
            raise ValueError(f"dequantised weights are fp32 or bf16, not {dtype}")
        self.dtype = dtype
        self.int8 = int8
        self._buf = torch.empty(0, dtype=dtype)

    def view(self, rows: int, cols: int) -> torch.Tensor:
        if self._buf.numel() < rows * cols:
            self._buf = torch.empty(rows * cols, dtype=self.dtype)
        return self._buf[: rows * cols].view(rows, cols)

    @property
    def nbytes(self) -> int:
        return self._buf.numel() * self._buf.element_size()


def _known_layout() -> Int4PackLayout:
    layout = int4pack_layout()
    if layout is None:
        raise RuntimeError("torch's int4 pack layout is not known on this CPU")
    return layout


def int4pack_dequant(
    packed: torch.Tensor,
    scales_zeros: torch.Tensor,
    group: int,
    out: torch.Tensor,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """W^T [K, N] into `out` (fp32 or bf16) from torch's int4 pack and its bf16 scales_zeros
    [K / group, N, 2]: w = (q - 8) * scale + zero. `lib`: a particular build (default: this
    CPU's)."""
    layout = _known_layout()
    k, n = out.shape
    if packed.numel() * 2 != n * k or scales_zeros.shape != (k // group, n, 2):
        raise ValueError(f"int4 pack / scales do not match a [{k}, {n}] output")
    rc = require_library(lib).int4pack_dequant(
        NATIVE_DTYPES[out.dtype],
        packed.data_ptr(),
        scales_zeros.data_ptr(),
        n,
        k,
        group,
        layout.block_n,
        int(layout.halves),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise MemoryError("int4pack_dequant: cannot allocate its scale rows")
    return out


def int4pack_rows(
    packed: torch.Tensor,
    scales_zeros: torch.Tensor,
    group: int,
    ids: torch.Tensor,
    repeat: int,
    dtype: torch.dtype,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """Rows `ids` of the [N, K] weight in torch's int4 pack ([N, K / 2]) as [T, K / repeat] in
    `dtype` (an embedding lookup from a quantized table; `repeat` slices of a row add up)."""
    layout = _known_layout()
    n, k = packed.shape[0], packed.shape[1] * 2
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), k // repeat, dtype=dtype)
    rc = require_library(lib).int4pack_rows(
        NATIVE_DTYPES[dtype],
        packed.data_ptr(),
        scales_zeros.data_ptr(),
        n,
        k,
        group,
        layout.block_n,
        int(layout.halves),
        ids.data_ptr(),
        ids.numel(),
        repeat,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    _check_rows(rc, n, "int4pack_rows")
    return out


def int4_native_rows(
    w: Int4Packed, ids: torch.Tensor, dtype: torch.dtype, lib: ctypes.CDLL | None = None
) -> torch.Tensor:
    """Rows `ids` of the native kernel's weight as [T, K / repeat] in `dtype` (an embedding
    lookup from the quantized table, as `int4pack_rows` reads torch's pack)."""
    n, k = w.packed.shape[0], w.packed.shape[1] * 2
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), k // w.repeat, dtype=dtype)
    rc = require_library(lib).int4_native_rows(
        NATIVE_DTYPES[dtype],
        w.packed.data_ptr(),
        w.scales.data_ptr(),
        w.mins.data_ptr(),
        n,
        k,
        ids.data_ptr(),
        ids.numel(),
        w.repeat,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    _check_rows(rc, n, "int4_native_rows")
    return out


def _check_rows(rc: int, n: int, kernel: str) -> None:
    """A row kernel's return code (csrc/weight_dequant.c table_rows) as the error it means."""
    if rc == -2:
        raise IndexError(f"a token id is outside the table's {n} rows")
    if rc != 0:
        raise MemoryError(f"{kernel}: cannot allocate its row buffers")


def int4_native_dequant(
    w: Int4Packed, out: torch.Tensor, lib: ctypes.CDLL | None = None
) -> torch.Tensor:
    """W [N, K] into `out` from the native kernel's layout (input read once: repeat 1)."""
    n, k = out.shape
    if w.repeat != 1 or w.packed.shape != (n, k // 2):
        raise ValueError(f"an Int4Packed of repeat 1 and shape [{n}, {k}] is needed")
    require_library(lib).int4_native_dequant(
        NATIVE_DTYPES[out.dtype],
        w.packed.data_ptr(),
        w.scales.data_ptr(),
        w.mins.data_ptr(),
        n,
        k,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def int8_dequant(
    q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, lib: ctypes.CDLL | None = None
) -> torch.Tensor:
    """W [N, K] into `out` from int8 codes and one bf16 scale a row."""
    n, k = out.shape
    if q.shape != (n, k) or scales.shape != (n,) or scales.dtype != torch.bfloat16:
        raise ValueError(f"int8 codes [{n}, {k}] and bf16 scales [{n}] are needed")
    require_library(lib).int8_dequant(
        NATIVE_DTYPES[out.dtype],
        q.data_ptr(),
        scales.data_ptr(),
        n,
        k,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out
