"""Prefill on 4-bit weights with 8-bit integer dot products (`csrc/int4_vnni.c`, AVX512-VNNI).

A projection over many tokens is compute-bound. On a CPU with AVX512-VNNI, multiplying int8
activations (quantized per block of 32, as llama.cpp does for its 4-bit formats) against the
4-bit codes runs ~1.5x the rate of expanding the weight to bf16 and calling a bf16 GEMM, the
path it replaces (`weight_dequant.py`). Each call expands the resident weight (torch's int4 pack
or the native kernel's layout) into the kernel's tiles, one byte a code, in an `Int8Scratch`
that every projection of a runner shares, then multiplies:

    Int8Scratch.from_int4pack(packed, scales_zeros, layout)   torch's pack -> TiledInt4
    Int8Scratch.from_native(w)                                 Int4Packed   -> TiledInt4
    vnni_matmul(x, tiled)                                      x [T, K] @ W^T -> [T, N]

`int8_prefill_available()` says whether this CPU and build serve it. `CHATSTORE_INT8_PREFILL`:
`auto` (default) serves it on AVX512-VNNI CPUs without AMX (where oneDNN's bf16 GEMM runs on AMX
tiles, far above VNNI's rate; not measured against this kernel, so not replaced), `1` on any
VNNI CPU, `0` never (the bf16 expansion then serves, as on CPUs without VNNI).
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import NamedTuple

import torch

from chatstore.kernels.int4_matmul import Int4Packed
from chatstore.kernels.native import NATIVE_DTYPES, cpu_flags, native_library

QBLOCK = 32
TILE_ROWS = 32  # rows of W a tile holds (csrc/int4_vnni.c)
_OFF = ("0", "false", "no", "off")


class TiledInt4(NamedTuple):
    """A weight in the kernel's tiles (views into an Int8Scratch: valid until its next use)."""

    codes: torch.Tensor  # [N * K] uint8, one code 0..15 a byte, tile-major
    scales: torch.Tensor  # [N * K / 32] float32
    mins: torch.Tensor  # [N * K / 32] float32: w = q * scale + min
    n: int
    k: int
    symmetric: bool  # min == -8 * scale everywhere (Q4_0, zero-free int4): one term fewer


def tiled_supported(n: int, k: int) -> bool:
    return n % TILE_ROWS == 0 and k % QBLOCK == 0


@functools.cache
def _built(lib: ctypes.CDLL) -> bool:
    return bool(lib.int4_vnni_built())


def int8_prefill_available(lib: ctypes.CDLL | None = None) -> bool:
    """Whether prefill GEMMs on int4 weights run here with integer dot products: the CPU has
    AVX512-VNNI, the loaded kernels hold the kernel, and CHATSTORE_INT8_PREFILL allows it (auto:
    not where AMX serves bf16; see the module doc). A bad value is a ValueError naming it."""
    setting = os.environ.get("CHATSTORE_INT8_PREFILL", "auto").strip().lower()
    if setting in _OFF:
        return False
    if setting not in ("auto", "1", "true", "yes", "on"):
        raise ValueError(f"CHATSTORE_INT8_PREFILL must be auto, 1 or 0, got {setting!r}")
    flags = cpu_flags()
    if setting == "auto" and "amx_bf16" in flags:
        return False
    lib = lib or native_library()
    return lib is not None and "avx512_vnni" in flags and _built(lib)


def _lib(lib: ctypes.CDLL | None) -> ctypes.CDLL:
    lib = lib or native_library()
    if lib is None:
        raise RuntimeError("native kernels are not available")
    return lib


class Int8Scratch:
    """The tiles every expanded weight of a runner lands in, grown to the largest; projections run
    one at a time, so a TiledInt4 is valid until the next projection's call."""

    def __init__(self) -> None:
        self._codes = torch.empty(0, dtype=torch.uint8)
        self._scales = torch.empty(0, dtype=torch.float32)
        self._mins = torch.empty(0, dtype=torch.float32)

    def _views(self, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not tiled_supported(n, k):
            raise ValueError(f"int8 prefill tiles need N % 32 == 0 and K % 32 == 0, got {n}x{k}")
        if self._codes.numel() < n * k:
            self._codes = torch.empty(n * k, dtype=torch.uint8)
            self._scales = torch.empty(n * k // QBLOCK, dtype=torch.float32)
            self._mins = torch.empty(n * k // QBLOCK, dtype=torch.float32)
        m = n * k // QBLOCK
        return self._codes[: n * k], self._scales[:m], self._mins[:m]

    @property
    def nbytes(self) -> int:
        return self._codes.numel() + 4 * (self._scales.numel() + self._mins.numel())

    def from_int4pack(
        self,
        packed: torch.Tensor,
        scales_zeros: torch.Tensor,
        block_n: int,
        halves: bool,
        symmetric: bool,
        lib: ctypes.CDLL | None = None,
    ) -> TiledInt4:
        """torch's int4 pack [N, K / 2] with bf16 scales_zeros [K / 32, N, 2] (group 32), laid
        out as `int4pack_layout()` found it."""
        n, k = packed.shape[0], packed.shape[1] * 2
        if scales_zeros.shape != (k // QBLOCK, n, 2):
            raise ValueError(f"int8 prefill takes groups of 32; scales {tuple(scales_zeros.shape)}")
        codes, scales, mins = self._views(n, k)
        rc = _lib(lib).int4pack_to_vnni(
            packed.data_ptr(),
            scales_zeros.data_ptr(),
            n,
            k,
            block_n,
            int(halves),
            codes.data_ptr(),
            scales.data_ptr(),
            mins.data_ptr(),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise ValueError(
                f"int4pack_to_vnni cannot tile a {n}x{k} weight in blocks of {block_n}"
            )
        return TiledInt4(codes, scales, mins, n, k, symmetric)

    def from_native(
        self, w: Int4Packed, symmetric: bool, lib: ctypes.CDLL | None = None
    ) -> TiledInt4:
        """The native int4 kernel's layout (input read once: repeat 1)."""
        n, k = w.packed.shape[0], w.packed.shape[1] * 2
        if w.repeat != 1:
            raise ValueError("int8 prefill takes weights read once along K (repeat 1)")
        codes, scales, mins = self._views(n, k)
        rc = _lib(lib).int4_native_to_vnni(
            w.packed.data_ptr(),
            w.scales.data_ptr(),
            w.mins.data_ptr(),
            n,
            k,
            codes.data_ptr(),
            scales.data_ptr(),
            mins.data_ptr(),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise ValueError(f"int4_native_to_vnni does not take a {n}x{k} weight")
        return TiledInt4(codes, scales, mins, n, k, symmetric)


def vnni_matmul(x: torch.Tensor, w: TiledInt4, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [T, K] (fp32 or bf16) @ W^T -> [T, N] in x's dtype, activations quantized per block of
    32 to int8 (module doc)."""
    if x.dim() != 2 or x.shape[1] != w.k:
        raise ValueError(f"input of width {w.k} expected, got {tuple(x.shape)}")
    x = x.contiguous()
    out = torch.empty(x.shape[0], w.n, dtype=x.dtype)
    rc = _lib(lib).int4_vnni_matmul(
        NATIVE_DTYPES[x.dtype],
        x.data_ptr(),
        x.shape[0],
        w.k,
        w.codes.data_ptr(),
        w.scales.data_ptr(),
        w.mins.data_ptr(),
        int(w.symmetric),
        w.n,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if rc == -1:
        raise MemoryError("int4_vnni_matmul: cannot allocate the quantized activations")
    if rc != 0:
        raise RuntimeError("int4_vnni_matmul: this build of the kernels has no VNNI kernel")
    return out
