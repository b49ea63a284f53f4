"""GGUF rows packed straight into the int4 kernels' layouts (`csrc/gguf_pack.c`).

torch's int4 kernel reads its weight in the layout `_convert_weight_to_int4pack_for_cpu` makes
from int32 codes [N, K]. Loading a GGUF that way decodes every code into a byte, widens it to
four, and packs: three passes over 4.5x the file's bytes (a 1B model: 5.4 of its 7.8 s load).
These write the same bytes from the file's blocks in one pass, each output row read from its
own address, so fused projections and permuted rows need no copy of the codes either:

    gguf_to_int4pack(row_addr, row_type, k_out, layout)     torch's kernel (`Int4Linear`)
        -> packed [N, k_out / 2] uint8, scales_zeros [k_out / 32, N, 2] bf16
    gguf_to_int4_native(row_addr, row_type, k_out, repeat)  the native kernel (`int4_matmul`)
        -> Int4Packed (`pack_int4`'s bytes: fp32 scales and mins)

Scales and zeros are computed from the blocks' f16 fields as
`chatstore/model/gguf_repack.scales_zeros` computes them (the tests compare bit for bit).
`row_addr[n]` is the address of output row n's bytes in the mapped file, `row_type[n]` its type
(`ROW_TYPES`); a Q8_0 row of K values gives k_out = 2 K codes (two 4-bit halves). The torch
layout is `weight_dequant.int4pack_layout()`'s: the one torch packs in on this CPU.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from chatstore.kernels.int4_matmul import QBLOCK, Int4Packed
from chatstore.kernels.native import require_library
from chatstore.kernels.weight_dequant import Int4PackLayout

ROW_TYPES = {"Q4_0": 0, "Q4_1": 1, "Q4_K": 2, "Q8_0": 3}  # csrc/gguf_pack.c's enum


def gguf_to_int4pack(
    row_addr: np.ndarray,
    row_type: np.ndarray,
    k_out: int,
    layout: Int4PackLayout,
    lib: ctypes.CDLL | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's pack [N, k_out / 2] uint8 and scales_zeros [k_out / 32, N, 2] bf16 of N rows
    (int64 addresses, int8 `ROW_TYPES` codes). The caller keeps the memory the addresses point
    into alive for the call. `lib`: a particular build (default: this CPU's)."""
    lib, addr, kinds = _checked(lib, row_addr, row_type)
    n = addr.shape[0]
    packed = torch.empty(n, k_out // 2, dtype=torch.uint8)
    scales_zeros = torch.empty(k_out // QBLOCK, n, 2, dtype=torch.bfloat16)
    rc = lib.gguf_to_int4pack(
        addr.ctypes.data,
        kinds.ctypes.data,
        n,
        k_out,
        layout.block_n,
        int(layout.halves),
        packed.data_ptr(),
        scales_zeros.data_ptr(),
        torch.get_num_threads(),
    )
    _raise_for(rc, k_out)
    return packed, scales_zeros


def gguf_to_int4_native(
    row_addr: np.ndarray,
    row_type: np.ndarray,
    k_out: int,
    repeat: int,
    lib: ctypes.CDLL | None = None,
) -> Int4Packed:
    """The native kernel's Int4Packed of N rows (as `gguf_to_int4pack`); `repeat`: how many
    times over the product reads its input (2 for Q8_0's halves)."""
    lib, addr, kinds = _checked(lib, row_addr, row_type)
    n = addr.shape[0]
    packed = torch.empty(n, k_out // 2, dtype=torch.uint8)
    scales = torch.empty(n, k_out // QBLOCK, dtype=torch.float32)
    mins = torch.empty(n, k_out // QBLOCK, dtype=torch.float32)
    rc = lib.gguf_to_int4_native(
        addr.ctypes.data,
        kinds.ctypes.data,
        n,
        k_out,
        packed.data_ptr(),
        scales.data_ptr(),
        mins.data_ptr(),
        torch.get_num_threads(),
    )
    _raise_for(rc, k_out)
    return Int4Packed(packed, scales, mins, repeat)


def _checked(
    lib: ctypes.CDLL | None, row_addr: np.ndarray, row_type: np.ndarray
) -> tuple[ctypes.CDLL, np.ndarray, np.ndarray]:
    lib = require_library(lib)
    addr = np.ascontiguousarray(row_addr, dtype=np.int64)
    kinds = np.ascontiguousarray(row_type, dtype=np.int8)
    if addr.shape != kinds.shape or addr.ndim != 1:
        raise ValueError("one address and one type a row are needed")
    return lib, addr, kinds


def _raise_for(rc: int, k_out: int) -> None:
    if rc == -2:
        raise ValueError(f"a row type outside {list(ROW_TYPES)}, or K = {k_out} it does not divide")
    if rc != 0:
        raise MemoryError("gguf_pack: cannot allocate a thread's buffers")
