"""Group-32 int4 weights times int8-quantized activations (`csrc/int4_matmul.c`), on the CPU.

    pack_int4(q, scale, zero)  Int4Weight's tensors -> Int4Packed (the kernel's layout)
    int4_matmul(x, packed)     x [T, K / repeat] fp32 or bf16 -> [T, N] in x's dtype

The weight convention is Int4Weight's (`model/quant_weights.py`): w = (q - 8) * scale + zero per
group of 32 along K, stored here as w = q * scale + min with min = zero - 8 * scale. Each token's
activations are quantized per block of 32 to int8 with their own step (what llama.cpp does for
its 4-bit formats), so the products are integer dot products; the result differs from the float
product of the same weight by the activations' rounding (half a step of max|x| / 127 in a block).
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from chatstore.kernels.native import NATIVE_DTYPES, require_library

QBLOCK = 32


class Int4Packed(NamedTuple):
    packed: torch.Tensor  # [N, K / 2] uint8, per block of 32: low nibbles codes 0..15, high 16..31
    scales: torch.Tensor  # [N, K / 32] float32
    mins: torch.Tensor  # [N, K / 32] float32: the value of code 0
    repeat: int  # the input is read this many times over along K (Int4Weight.input_repeat)

    @property
    def shape(self) -> tuple[int, int]:
        """[N, K] of the matrix it stands for (the input's width)."""
        n, half = self.packed.shape
        return n, 2 * half // self.repeat


def int4_matmul_supported(k: int, group: int, repeat: int) -> bool:
    return group == QBLOCK and k % QBLOCK == 0 and (k // repeat) % QBLOCK == 0


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, repeat: int) -> Int4Packed:
    """q [N, K] codes 0..15, scale / zero [N, K / 32] (Int4Weight's tensors)."""
    n, k = q.shape
    if not int4_matmul_supported(k, k // max(1, scale.shape[1]), repeat):
        raise ValueError(f"int4_matmul needs groups of 32 and K % 32 == 0, got {n}x{k}")
    blocks = q.reshape(n, k // QBLOCK, 2, QBLOCK // 2).to(torch.uint8)  # [N, B, halves, 16]
    packed = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    scale = scale.float()
    mins = (zero.float() - 8 * scale).contiguous()
    return Int4Packed(packed, scale.contiguous(), mins, repeat)


def int4_matmul(x: torch.Tensor, w: Int4Packed, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [T, K / repeat] @ W^T -> [T, N] in x's dtype; `lib` a particular build (default: this
    CPU's)."""
    lib = require_library(lib)
    x = x.contiguous()
    n = w.packed.shape[0]
    k = 2 * w.packed.shape[1]
    out = torch.empty(x.shape[0], n, dtype=x.dtype)
    rc = lib.int4_matmul(
        NATIVE_DTYPES[x.dtype],
        x.data_ptr(),
        x.shape[0],
        k,
        w.repeat,
        w.packed.data_ptr(),
        w.scales.data_ptr(),
        w.mins.data_ptr(),
        n,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise MemoryError("int4_matmul: cannot allocate the quantized activations")
    return out
