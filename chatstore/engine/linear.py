"""A projection `x @ W^T (+ b)` that runs each token count on whichever GEMM is faster for it.

On a CPU with oneDNN, a weight reordered once into oneDNN's blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, what inductor's freezing pass emits) skips the
per-call packing that `torch.mm` pays; measured on the default model's shapes (fp32, 2 cores,
the 30 layers' weights streamed from DRAM as in a real step), stacked projections ran:

    tokens           1      8     32    128
    torch.mm     14.3 ms  31.3   44.6  105.6
    prepacked    21.4 ms  22.9   39.4  101.1

so a single token (decode at batch 1, a GEMV that MKL already runs at DRAM bandwidth) stays on
`torch.mm` and every larger count takes the packed weight. On CUDA, or where the reorder op is
missing, there is one path: `torch.mm` / `torch.addmm`.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

PACKED_MIN_TOKENS = 2  # from the table above: packing loses at 1 token and wins from 8 on


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN prepacks a weight of this dtype here. bf16 needs AVX512 BW/VL/DQ (or
    AVX-NE-CONVERT) on the CPU: on an AVX2-only CPU oneDNN refuses it, and bf16 is emulated there
    anyway (`dtype = auto` computes in fp32 on such a CPU)."""
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and (dtype != torch.bfloat16 or bf16_prepack_supported())
    )


def bf16_prepack_supported() -> bool:
    """oneDNN's own test of the CPU for bf16 (what `_reorder_linear_weight` refuses without)."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe()) if probe is not None else False


class Linear:
    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        pack: bool,
        single_rows: bool = True,
    ) -> None:
        """weight [out, in] as transformers holds it (not copied for the `torch.mm` path).
        `single_rows=False`: no call has fewer than PACKED_MIN_TOKENS rows (a quantized
        projection's prefill copy), so once packed the plain weight is not kept."""
        self.weight_t: torch.Tensor | None = weight.detach().t()  # [in, out] view: F.linear's mm
        self.bias = None if bias is None else bias.detach()
        self.packed: torch.Tensor | None = None
        if pack:
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 32)
            except RuntimeError as exc:  # an op this build lacks for the dtype: stay on mm
                log.warning("prepacking a %s weight failed, using torch.mm: %s", weight.dtype, exc)
        if self.packed is not None and not single_rows:
            self.weight_t = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and (x.shape[0] >= PACKED_MIN_TOKENS or self.weight_t is None):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        assert self.weight_t is not None
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)
