"""Prefill on 4-bit weights with 8-bit integer dot products (`csrc/int4_vnni.c`, AVX512-VNNI).

A projection over many tokens is compute-bound. On a CPU with AVX512-VNNI, multiplying int8
activations (quantized per block of 32, as llama.cpp does for its 4-bit formats) against the
4-bit codes runs ~1.5x the rate of expanding the weight to bf16 and calling a bf16 GEMM, the
path it replaces (`weight_dequant.py`). The kernel reads the resident weight as it is (torch's
int4 pack or the native kernel's layout): each thread lays 64 rows at a time out as its tiles in
a buffer of its own, so no weight-sized scratch exists.

    vnni_matmul_int4pack(x, packed, scales_zeros, layout, symmetric)   torch's pack
    vnni_matmul_native(x, w, symmetric)                                 Int4Packed
    -> x [T, K] @ W^T as [T, N] in x's dtype

`int8_prefill_available()` says whether this CPU and build serve it. `CHATSTORE_INT8_PREFILL`:
`auto` (default) serves it on AVX512-VNNI CPUs without AMX (where oneDNN's bf16 GEMM runs on AMX
tiles, far above VNNI's rate; not measured against this kernel, so not replaced), `1` on any
VNNI CPU, `0` never (the bf16 expansion then serves, as on CPUs without VNNI).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from chatstore.kernels.int4_matmul import Int4Packed
from chatstore.kernels.native import (
    NATIVE_DTYPES,
    OFF_VALUES,
    cpu_flags,
    native_library,
    require_library,
)
from chatstore.kernels.weight_dequant import Int4PackLayout

QBLOCK = 32
SLAB_ROWS = 64  # rows of W a thread lays out at a time (csrc/int4_vnni.c's SLAB)


def tiled_supported(n: int, k: int) -> bool:
    """Shapes the kernel takes: whole slabs of 64 rows, whole blocks of 32 along K."""
    return n % SLAB_ROWS == 0 and k % QBLOCK == 0


@functools.cache
def _built(lib: ctypes.CDLL) -> bool:
    return bool(lib.int4_vnni_built())


def int8_prefill_available(lib: ctypes.CDLL | None = None) -> bool:
    """Whether prefill GEMMs on int4 weights run here with integer dot products: the CPU has
    AVX512-VNNI, the loaded kernels hold the kernel, and CHATSTORE_INT8_PREFILL allows it (auto:
    not where AMX serves bf16; see the module doc). A bad value is a ValueError naming it."""
    setting = os.environ.get("CHATSTORE_INT8_PREFILL", "auto").strip().lower()
    if setting in OFF_VALUES:
        return False
    if setting not in ("auto", "1", "true", "yes", "on"):
        raise ValueError(f"CHATSTORE_INT8_PREFILL must be auto, 1 or 0, got {setting!r}")
    flags = cpu_flags()
    if setting == "auto" and "amx_bf16" in flags:
        return False
    lib = lib or native_library()
    return lib is not None and "avx512_vnni" in flags and _built(lib)


def _check(rc: int, n: int, k: int) -> None:
    if rc == -1:
        raise MemoryError("int8 prefill: cannot allocate the quantized activations or a slab")
    if rc != 0:
        raise RuntimeError(
            f"int8 prefill: this build of the kernels has no VNNI kernel, or cannot take {n}x{k}"
        )


def _out(x: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"input of width {k} expected, got {tuple(x.shape)}")
    if not tiled_supported(n, k):
        raise ValueError(f"int8 prefill needs N % 64 == 0 and K % 32 == 0, got {n}x{k}")
    return x.contiguous(), torch.empty(x.shape[0], n, dtype=x.dtype)


def vnni_matmul_int4pack(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales_zeros: torch.Tensor,
    layout: Int4PackLayout,
    symmetric: bool,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """x [T, K] (fp32 or bf16) @ W^T -> [T, N] in x's dtype, W in torch's int4 pack [N, K / 2]
    with bf16 scales_zeros [K / 32, N, 2] laid out as `layout` (int4pack_layout()); `symmetric`:
    every zero is 0 (the kernel then skips the min term)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    if scales_zeros.shape != (k // QBLOCK, n, 2):
        raise ValueError(f"int8 prefill takes groups of 32; scales {tuple(scales_zeros.shape)}")
    x, out = _out(x, n, k)
    rc = require_library(lib).int4pack_vnni_matmul(
        NATIVE_DTYPES[x.dtype],
        x.data_ptr(),
        x.shape[0],
        k,
        packed.data_ptr(),
        scales_zeros.data_ptr(),
        layout.block_n,
        int(layout.halves),
        int(symmetric),
        n,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    _check(rc, n, k)
    return out


def vnni_matmul_native(
    x: torch.Tensor, w: Int4Packed, symmetric: bool, lib: ctypes.CDLL | None = None
) -> torch.Tensor:
    """The same for the native int4 kernel's layout (input read once: repeat 1); `symmetric`:
    mins == -8 * scales everywhere."""
    if w.repeat != 1:
        raise ValueError("int8 prefill takes weights read once along K (repeat 1)")
    n, k = w.packed.shape[0], w.packed.shape[1] * 2
    x, out = _out(x, n, k)
    rc = require_library(lib).int4_native_vnni_matmul(
        NATIVE_DTYPES[x.dtype],
        x.data_ptr(),
        x.shape[0],
        k,
        w.packed.data_ptr(),
        w.scales.data_ptr(),
        w.mins.data_ptr(),
        int(symmetric),
        n,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    _check(rc, n, k)
    return out
