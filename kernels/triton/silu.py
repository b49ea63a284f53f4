"""SiLU(gate) * up over the fused gate/up projection: gu [R, 2 I] = [gate | up] per row.

Rounding as torch's op-by-op arithmetic in the tensor's dtype: silu(gate) rounded to the dtype,
then the product rounded (the contract of `chatstore.kernels.fused_ops`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from chatstore.kernels.triton.launch import emulate_bf16, to_dtype

# Columns a program covers: an MLP row (I = 1536 for SmolLM2, 8192 for Llama-3.2-1B) is split
# over the grid's second axis.
BLOCK = 1024


@triton.jit
def silu_mul_kernel(
    gu_ptr, out_ptr, stride_gu, stride_out, inner, BLOCK: tl.constexpr, EMULATE_BF16: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0)
    up = tl.load(gu_ptr + row * stride_gu + inner + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = to_dtype(g / (1.0 + tl.exp(-g)), gate.dtype, EMULATE_BF16).to(tl.float32)
    out = to_dtype(silu * up.to(tl.float32), gate.dtype, EMULATE_BF16)
    tl.store(out_ptr + row * stride_out + cols, out, mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [R, 2 I] -> silu(gate) * up [R, I]."""
    rows, width = gate_up.shape
    if gate_up.stride(1) != 1:
        raise ValueError("silu_mul: rows must be contiguous")
    inner = width // 2
    out = torch.empty((rows, inner), dtype=gate_up.dtype, device=gate_up.device)
    silu_mul_kernel[(rows, triton.cdiv(inner, BLOCK))](
        gate_up,
        out,
        gate_up.stride(0),
        out.stride(0),
        inner,
        BLOCK=BLOCK,
        EMULATE_BF16=emulate_bf16(gate_up.dtype),
    )
    return out
