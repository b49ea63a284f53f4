"""GGUF rows packed straight into torch's int4 CPU layout (`csrc/gguf_pack.c`).

torch's int4 kernel reads its weight in the layout `_convert_weight_to_int4pack_for_cpu` makes
from int32 codes [N, K]. Loading a GGUF that way decodes every code into a byte, widens it to
four, and packs: three passes over 4.5x the file's bytes (a 1B model: 5.4 of its 7.8 s load).
`gguf_to_int4pack` writes the same bytes from the file's blocks in one pass, each output row read
from its own address, so fused projections and permuted rows need no copy of the codes either.

    gguf_to_int4pack(row_addr, row_type, k_out, layout)
        -> packed [N, k_out / 2] uint8, scales_zeros [k_out / 32, N, 2] bf16

Both are what `Int4Linear` hands torch's kernel; the scales and zeros are computed from the
blocks' f16 fields as `chatstore/model/gguf_repack.scales_zeros` computes them, then rounded to
bf16 (the test compares them bit for bit).

`row_addr[n]` is the address of output row n's bytes in the mapped file, `row_type[n]` its type
(`ROW_TYPES`). The layout is `weight_dequant.int4pack_layout()`'s: the one torch packs in here.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from chatstore.kernels.native import native_library
from chatstore.kernels.weight_dequant import Int4PackLayout

ROW_TYPES = {"Q4_0": 0, "Q4_1": 1, "Q4_K": 2, "Q8_0": 3}  # csrc/gguf_pack.c's enum
GROUP = 32  # codes a scale and zero cover, in every type


def gguf_to_int4pack(
    row_addr: np.ndarray,
    row_type: np.ndarray,
    k_out: int,
    layout: Int4PackLayout,
    lib: ctypes.CDLL | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The [N, k_out / 2] uint8 pack and [k_out / 32, N, 2] bf16 scales_zeros of N rows (int64
    addresses, int8 `ROW_TYPES` codes) of k_out codes each (a Q8_0 row of K values gives 2 K).
    The caller keeps the memory the addresses point into alive for the call. `lib`: a
    particular build (default: this CPU's)."""
    lib = lib or native_library()
    if lib is None:
        raise RuntimeError("native kernels are not available")
    addr = np.ascontiguousarray(row_addr, dtype=np.int64)
    kinds = np.ascontiguousarray(row_type, dtype=np.int8)
    if addr.shape != kinds.shape or addr.ndim != 1:
        raise ValueError("one address and one type a row are needed")
    n = addr.shape[0]
    packed = torch.empty(n, k_out // 2, dtype=torch.uint8)
    scales_zeros = torch.empty(k_out // GROUP, n, 2, dtype=torch.bfloat16)
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
    if rc == -2:
        raise ValueError(f"a row type outside {list(ROW_TYPES)}, or K = {k_out} it does not divide")
    if rc != 0:
        raise MemoryError("gguf_to_int4pack: cannot allocate a block's codes")
    return packed, scales_zeros
