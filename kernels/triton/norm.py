"""RMSNorm and the residual add fused with it, one program per row.

    rms_norm        out = w * (x / sqrt(mean(x^2) + eps))           x, out [R, H]; w [H]
    add_rms_norm    h += delta (in place);  out = rms_norm(h)

Rounding as transformers' LlamaRMSNorm in the tensor's dtype (the contract of
`chatstore.kernels.fused_ops`): the residual sum rounded to the dtype, the normalised value
rounded to the dtype before the weight multiplies it, the product rounded once more; the sum of
squares and rsqrt in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from chatstore.kernels.triton.launch import emulate_bf16, next_pow2, to_dtype


@triton.jit
def rms_norm_kernel(
    x_ptr,  # [R, H]; with ADD: h, updated in place
    delta_ptr,  # [R, H] (ADD only)
    w_ptr,  # [H]
    out_ptr,  # [R, H]
    stride_x,
    stride_delta,
    stride_out,
    width,
    eps,
    ADD: tl.constexpr,
    BLOCK: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD:
        delta = tl.load(delta_ptr + row * stride_delta + cols, mask=mask, other=0.0)
        x = to_dtype(x.to(tl.float32) + delta.to(tl.float32), x.dtype, EMULATE_BF16)
        tl.store(x_ptr + row * stride_x + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / width + eps)
    normed = to_dtype(xf * inv, x.dtype, EMULATE_BF16).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = to_dtype(w * normed, out_ptr.dtype.element_ty, EMULATE_BF16)
    tl.store(out_ptr + row * stride_out + cols, out, mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [R, H] (rows may be strided), weight [H] of x's dtype -> [R, H]."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, x, weight, out, eps, add=False)
    return out


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """h [R, H] += delta in place; returns rms_norm(h)."""
    out = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    _launch(h, delta, weight, out, eps, add=True)
    return out


def _launch(
    x: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    eps: float,
    add: bool,
) -> None:
    rows, width = x.shape
    if x.stride(1) != 1 or delta.stride(1) != 1:
        raise ValueError("rms_norm: rows must be contiguous")
    rms_norm_kernel[(rows,)](
        x,
        delta,
        weight,
        out,
        x.stride(0),
        delta.stride(0),
        out.stride(0),
        width,
        eps,
        ADD=add,
        BLOCK=next_pow2(width),
        EMULATE_BF16=emulate_bf16(x.dtype),
    )
