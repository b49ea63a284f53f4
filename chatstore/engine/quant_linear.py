"""Weight-only quantized projections on torch's CPU kernels, called like `linear.Linear`.

    Int8Linear   torch.ops.aten._weight_int8pack_mm(x, q [N, K] int8, scales [N])
    Int4Linear   torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros)

Both kernels run on bf16 activations: torch 2.13's CPU kernels accept fp32 and fp16 too, but
only the bf16 path is vectorised (measured, 1 thread, a 3072 x 576 weight, 1 / 4 tokens: int4
3.07 / 16.6 ms with fp32 activations, 0.097 / 0.170 ms with bf16; int8 1.43 / 8.43 vs 0.096 /
0.193; the fp32 dense GEMM 0.135 / 0.156). So a fp32 compute dtype converts at the edges: the
input is rounded to bf16, the output (fp32-accumulated, bf16) widened back and the bias added in
fp32. The scales (and zeros) are bf16, as the kernels require of the activations. Where a token
count runs faster as a 16-bit GEMM (prefill: see `weight_plan.py` for the measured table and the
choice per shape), the call expands the weight just in time into a `DequantScratch` the runner's
projections share and multiplies that (`kernels/weight_dequant.py`): no 16-bit copy stays
resident. `dense_from` is the first token count that computes so. A projection may instead be
given a `linear.Linear` for those counts (`dense`): the tied lm_head's is the embedding table
itself, and where weights cannot be expanded here (no native kernels) it is a 16-bit copy.

Int4Linear runs on one of two kernels (`int4_kernel()`, logged at start with the weights):

    torch    `_weight_int4pack_mm_for_cpu`, bf16 activations: fast where the CPU computes bf16
             (AVX512-BF16), emulated elsewhere
    native   `chatstore.kernels.int4_matmul` (csrc/int4_matmul.c): activations quantized to int8
             per block of 32, integer dot products (VPMADDUBSW on AVX2), as llama.cpp computes its
             4-bit formats. Decode at batch 1 of the embedded model, fp32, both kernels in one
             process, steps interleaved: 1.12x torch's with torch's AVX2 kernels
             (ATEN_CPU_CAPABILITY=avx2 on this project's Intel Xeon: 34.5 vs 30.9 tok/s best,
             31.3 vs 27.3 median), 0.78x torch's where torch computes bf16 (AVX512-BF16)

`auto` takes native on a CPU without AVX512-BF16 when the native kernels build, torch
otherwise; `CHATSTORE_INT4_KERNEL=torch|native` pins one (group-32 weights only; others torch).
"""

from __future__ import annotations

import os

import torch

from chatstore.engine.linear import Linear
from chatstore.kernels import native
from chatstore.kernels.int4_matmul import (
    QBLOCK,
    Int4Packed,
    int4_matmul,
    int4_matmul_supported,
    pack_int4,
)
from chatstore.kernels.int4_vnni import (
    tiled_supported,
    vnni_matmul_int4pack,
    vnni_matmul_native,
)
from chatstore.kernels.weight_dequant import (
    DequantScratch,
    int4_native_dequant,
    int4_native_rows,
    int4pack_dequant,
    int4pack_layout,
    int4pack_rows,
    int8_dequant,
)
from chatstore.model.quant_weights import Int4Weight, Int8Weight, PackedInt4Weight

NEVER = 1 << 62  # dense_from for a projection that always computes quantized
KERNEL_DTYPE = torch.bfloat16  # the activations' dtype in both kernels (see the module doc)


def int4_supported(n: int, k: int, group: int) -> bool:
    """Shapes the int4 CPU kernel packs: N a multiple of 16, K of the group."""
    return n % 16 == 0 and k % group == 0


INT4_KERNELS = ("auto", "torch", "native")


def int4_kernel(setting: str | None = None) -> str:
    """torch | native for `setting` (default: CHATSTORE_INT4_KERNEL, else auto; see the doc)."""
    choice = (setting or os.environ.get("CHATSTORE_INT4_KERNEL") or "auto").strip().lower()
    if choice not in INT4_KERNELS:
        raise ValueError(f"int4 kernel must be one of {list(INT4_KERNELS)}, got {choice!r}")
    if choice != "auto":
        return choice
    if native.cpu_has_avx512_bf16() or native.native_library() is None:
        return "torch"
    return "native"


def kernels_available() -> bool:
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int8pack_mm") and hasattr(ops, "_weight_int4pack_mm_for_cpu")


PACK_ROWS = 4096  # rows packed at a time: a multiple of every block torch packs in (64, 32)


def pack_for_torch(q: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] in torch's int4 layout [N, K / 2], packed a slice of rows at a time: the
    op takes int32 codes (4 bytes a code; an 8B model's head would need 2 GB at once), and its
    layout is block-major over rows, so a slice of whole blocks packs to the same bytes."""
    n, k = q.shape
    packed = torch.empty(n, k // 2, dtype=torch.uint8)
    for start in range(0, n, PACK_ROWS):
        rows = q[start : start + PACK_ROWS].to(torch.int32).contiguous()
        # innerKTiles is a CUDA tiling knob; the CPU packing ignores it (any value packs alike)
        packed[start : start + PACK_ROWS] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            rows, 2
        )
    return packed


class _DenseFallback:
    """The 16-bit side of a quantized projection: calls of `dense_from` tokens and more run on
    `dense` where one is given, else on the weight expanded into `scratch`."""

    def __init__(
        self,
        bias: torch.Tensor | None,
        dense: Linear | None,
        dense_from: int,
        scratch: DequantScratch | None,
    ) -> None:
        self.bias = None if bias is None else bias.detach()
        self.dense = dense
        self.scratch = scratch
        self.dense_from = dense_from if dense is not None or scratch is not None else NEVER

    def _finish(self, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        y = y.to(dtype)  # a no-op in bf16
        return y if self.bias is None else y.add_(self.bias)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None:
            return self.dense(x)
        assert self.scratch is not None
        w_t = self._expand(self.scratch)  # [K, N], valid until the next projection's call
        x = x.to(w_t.dtype)
        return torch.mm(x, w_t) if self.bias is None else torch.addmm(self.bias, x, w_t)

    def _expand(self, scratch: DequantScratch) -> torch.Tensor:
        raise NotImplementedError


class Int8Linear(_DenseFallback):
    def __init__(
        self,
        weight: Int8Weight,
        bias: torch.Tensor | None,
        dense: Linear | None = None,
        dense_from: int = NEVER,
        scratch: DequantScratch | None = None,
    ) -> None:
        super().__init__(bias, dense, dense_from, scratch)
        self.q = weight.q.contiguous()  # [N, K] int8
        self.scales = weight.scale.to(KERNEL_DTYPE).contiguous()  # [N]
        self.shape = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= self.dense_from:
            return self._dense(x)
        y = torch.ops.aten._weight_int8pack_mm(x.to(KERNEL_DTYPE), self.q, self.scales)
        return self._finish(y, x.dtype)

    def _expand(self, scratch: DequantScratch) -> torch.Tensor:
        n, k = self.shape
        return int8_dequant(self.q, self.scales, scratch.view(n, k)).t()


class Int4Linear(_DenseFallback):
    def __init__(
        self,
        weight: Int4Weight | PackedInt4Weight | Int4Packed,
        bias: torch.Tensor | None,
        dense: Linear | None = None,
        dense_from: int = NEVER,
        kernel: str = "torch",
        scratch: DequantScratch | None = None,
    ) -> None:
        """`kernel`: torch | native (int4_kernel()); native needs groups of 32, else torch.
        A weight read over a repeated input (input_repeat > 1) is never expanded: only the
        lm_head is one, and it sees a row per sequence. A weight already in a kernel's layout
        (built from a GGUF's blocks: PackedInt4Weight torch's, Int4Packed the native one's)
        runs on that kernel."""
        if isinstance(weight, Int4Packed):
            group, repeat = QBLOCK, weight.repeat
        else:
            group, repeat = weight.group, weight.input_repeat
        super().__init__(bias, dense, dense_from, scratch if repeat == 1 else None)
        n, k = weight.shape[0], weight.shape[1] * repeat
        if not int4_supported(n, k, group):
            raise ValueError(f"int4 needs N % 16 == 0 and K % group == 0, got {n}x{k}")
        self.group, self.repeat, self.shape = group, repeat, weight.shape
        self._symmetric: bool | None = None  # min == -8 scale everywhere, found at first use
        self.kernel = "native" if isinstance(weight, Int4Packed) else "torch"
        if isinstance(weight, Int4Packed):
            self.native = weight
        elif isinstance(weight, PackedInt4Weight):
            self.packed, self.scales_zeros = weight.packed, weight.scales_zeros
        elif kernel == "native" and int4_matmul_supported(k, group, repeat):
            self.kernel = "native"
            self.native = pack_int4(weight.q, weight.scale, weight.zero, repeat)
        else:
            self.packed = pack_for_torch(weight.q)  # [N, K / 2] uint8
            self.scales_zeros = (
                torch.stack([weight.scale.t(), weight.zero.t()], dim=-1)
                .to(KERNEL_DTYPE)
                .contiguous()
            )  # [K / group, N, 2]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= self.dense_from:
            return self._dense(x)
        if self.kernel == "native":
            return self._finish(int4_matmul(x, self.native), x.dtype)
        xk = x.to(KERNEL_DTYPE)
        if self.repeat > 1:
            xk = xk.repeat(1, self.repeat)  # [T, K * repeat]: see Int4Weight.input_repeat
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            xk, self.packed, self.group, self.scales_zeros
        )
        return self._finish(y, x.dtype)

    def _expand(self, scratch: DequantScratch) -> torch.Tensor:
        n, k = self.shape
        if self.kernel == "native":
            return int4_native_dequant(self.native, scratch.view(n, k)).t()
        return int4pack_dequant(self.packed, self.scales_zeros, self.group, scratch.view(k, n))

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        """Calls of `dense_from` tokens and more: integer dot products on the 4-bit weight as it
        is where the runner prefills so (AVX512-VNNI; int4_vnni.py), else a 16-bit GEMM."""
        y = self._int8_product(x)
        if y is None:
            return super()._dense(x)
        return y if self.bias is None else y.add_(self.bias)

    def _int8_product(self, x: torch.Tensor) -> torch.Tensor | None:
        scratch = self.scratch
        if self.dense is not None or scratch is None or not scratch.int8:
            return None
        n, k = self.shape
        if self.group != QBLOCK or self.repeat != 1 or not tiled_supported(n, k):
            return None
        if self.kernel == "native":
            if self._symmetric is None:
                self._symmetric = torch.equal(self.native.mins, -8 * self.native.scales)
            return vnni_matmul_native(x, self.native, self._symmetric)
        layout = int4pack_layout()
        if layout is None:
            return None
        if self._symmetric is None:
            self._symmetric = not bool(self.scales_zeros[..., 1].any())
        return vnni_matmul_int4pack(x, self.packed, self.scales_zeros, layout, self._symmetric)


class PackedRows:
    """An embedding table looked up in an int4 weight's pack, either kernel's (the tied head's,
    or the GGUF's own token_embd packed): a step expands the rows it reads (~1 KB a token), and
    no 16-bit table stays resident. Called like `F.embedding(ids, table)`."""

    def __init__(self, table: Int4Linear, dtype: torch.dtype) -> None:
        self.table, self.dtype = table, dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        t = self.table
        if t.kernel == "native":
            return int4_native_rows(t.native, ids, self.dtype)
        return int4pack_rows(t.packed, t.scales_zeros, t.group, ids, t.repeat, self.dtype)
