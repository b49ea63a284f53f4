"""Weight-only quantized projections on torch's CPU kernels, called like `linear.Linear`.

    Int8Linear   torch.ops.aten._weight_int8pack_mm(x, q [N, K] int8, scales [N])
    Int4Linear   torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros)

Both kernels run on bf16 activations: torch 2.13's CPU kernels accept fp32 and fp16 too, but
only the bf16 path is vectorised (measured, 1 thread, a 3072 x 576 weight, 1 / 4 tokens: int4
3.07 / 16.6 ms with fp32 activations, 0.097 / 0.170 ms with bf16; int8 1.43 / 8.43 vs 0.096 /
0.193; the fp32 dense GEMM 0.135 / 0.156). So a fp32 compute dtype converts at the edges: the
input is rounded to bf16, the output (fp32-accumulated, bf16) widened back and the bias added in
fp32. The scales (and zeros) are bf16, as the kernels require of the activations. Where a token
count runs faster on the prepacked 16-bit GEMM (prefill: see `weight_plan.py` for the measured
table and the choice per shape), the projection also holds a `linear.Linear` and hands those
calls to it: `dense_from` is the first token count it takes.
"""

from __future__ import annotations

import torch

from chatstore.engine.linear import Linear
from chatstore.engine.quant_weights import Int4Weight, Int8Weight

NEVER = 1 << 62  # dense_from for a projection without a 16-bit copy
KERNEL_DTYPE = torch.bfloat16  # the activations' dtype in both kernels (see the module doc)


def int4_supported(n: int, k: int, group: int) -> bool:
    """Shapes the int4 CPU kernel packs: N a multiple of 16, K of the group."""
    return n % 16 == 0 and k % group == 0


def kernels_available() -> bool:
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int8pack_mm") and hasattr(ops, "_weight_int4pack_mm_for_cpu")


class _DenseFallback:
    def __init__(self, bias: torch.Tensor | None, dense: Linear | None, dense_from: int) -> None:
        self.bias = None if bias is None else bias.detach()
        self.dense = dense
        self.dense_from = dense_from if dense is not None else NEVER

    def _finish(self, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        y = y.to(dtype)  # a no-op in bf16
        return y if self.bias is None else y.add_(self.bias)


class Int8Linear(_DenseFallback):
    def __init__(
        self,
        weight: Int8Weight,
        bias: torch.Tensor | None,
        dense: Linear | None = None,
        dense_from: int = NEVER,
    ) -> None:
        super().__init__(bias, dense, dense_from)
        self.q = weight.q.contiguous()  # [N, K] int8
        self.scales = weight.scale.to(KERNEL_DTYPE).contiguous()  # [N]
        self.shape = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and x.shape[0] >= self.dense_from:
            return self.dense(x)
        y = torch.ops.aten._weight_int8pack_mm(x.to(KERNEL_DTYPE), self.q, self.scales)
        return self._finish(y, x.dtype)


class Int4Linear(_DenseFallback):
    def __init__(
        self,
        weight: Int4Weight,
        bias: torch.Tensor | None,
        dense: Linear | None = None,
        dense_from: int = NEVER,
    ) -> None:
        super().__init__(bias, dense, dense_from)
        n, k = weight.q.shape
        if not int4_supported(n, k, weight.group):
            raise ValueError(f"int4 needs N % 16 == 0 and K % group == 0, got {n}x{k}")
        self.group = weight.group
        self.repeat = weight.input_repeat
        self.shape = weight.shape
        # innerKTiles is a CUDA tiling knob; the CPU packing ignores it (any value packs alike).
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            weight.q.to(torch.int32).contiguous(), 2
        )  # [N, K / 2] uint8
        self.scales_zeros = (
            torch.stack([weight.scale.t(), weight.zero.t()], dim=-1).to(KERNEL_DTYPE).contiguous()
        )  # [K / group, N, 2]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and x.shape[0] >= self.dense_from:
            return self.dense(x)
        xk = x.to(KERNEL_DTYPE)
        if self.repeat > 1:
            xk = xk.repeat(1, self.repeat)  # [T, K * repeat]: see Int4Weight.input_repeat
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            xk, self.packed, self.group, self.scales_zeros
        )
        return self._finish(y, x.dtype)
