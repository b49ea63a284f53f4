"""What every launcher here needs: sizes rounded for Triton, and the interpreter's bf16 gaps.

Triton 3.9's CPU interpreter (TRITON_INTERPRET=1, what CI runs) keeps a bf16 tensor as its
uint16 bits, and two of its bf16 operations differ from a GPU's:

- `tl.dot` runs np.matmul on those bits: a 16x16 bf16 product came out ~1e10 off;
- fp32 -> bf16 (`.to`, or a store into a bf16 tensor) truncates where a GPU rounds to nearest
  even: up to one bf16 ulp off, so no bf16 result matched torch's.

So a kernel takes `EMULATE_BF16` (true only for bf16 in the interpreter): its dots then see bf16
values widened to fp32 (exact products and fp32 sums, what a GPU's bf16 MMA computes) and
`to_dtype` rounds to nearest even by hand before narrowing. On a GPU the flag is false and the
kernels run plain bf16 dots and casts.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (Triton's block shapes must be powers of two)."""
    return 1 << max(0, n - 1).bit_length()


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def emulate_bf16(dtype: torch.dtype) -> bool:
    """Whether a kernel over `dtype` tensors must work around the interpreter's bf16 gaps."""
    return dtype == torch.bfloat16 and interpreting()


@triton.jit
def to_dtype(x, dtype: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """fp32 x narrowed to `dtype`, rounded to nearest even (see the module's docstring)."""
    if EMULATE_BF16:
        bits = x.to(tl.int32, bitcast=True)
        # Round half to even at bit 16, then drop the low half: exact in bf16 after that.
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)
