"""Weight-only quantized weights in the layouts torch's CPU kernels read, and their references.

    int8 (W8A16)   w[n, k] = q[n, k] * scale[n]                      q int8, one scale a row
    int4 (W4A16)   w[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]   q in 0..15, g = k // group

The int4 convention is `_weight_int4pack_mm_for_cpu`'s (its scales_and_zeros [K/group, N, 2]):
checked against a float matmul in tests/model/test_quant_weights.py. An asymmetric code with min
m and step d (w = d q + m, GGUF's Q4_1, or a min/max quantizer) is that form with scale = d and
zero = m + 8 d; a symmetric one (w = d (q - 8), Q4_0) has zero = 0.

These are plain tensors (what a quantizer or the GGUF repacker produces); `quant_linear.py`
packs them for the kernels. `dequantize()` is the float reference the tests compare with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, TypeVar

import torch

INT4_GROUPS = (32, 64)  # group sizes the int4 path accepts (GGUF's blocks are 32)


class Int8Weight(NamedTuple):
    q: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N] float32

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]  # [N, K] float32

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.q.shape
        return n, k


class Int4Weight(NamedTuple):
    q: torch.Tensor  # [N, K] uint8, values 0..15
    scale: torch.Tensor  # [N, K / group] float32
    zero: torch.Tensor  # [N, K / group] float32: the value q = 8 stands for
    group: int
    # > 1: the input is read this many times over (x -> [x, x]) and the K / input_repeat wide
    # slices of the weight add up: how an 8-bit GGUF code rides on two 4-bit ones (gguf_repack)
    input_repeat: int = 1

    def dequantize(self) -> torch.Tensor:
        """The weight the product computes with: [N, K / input_repeat] float32."""
        s = self.scale.repeat_interleave(self.group, dim=1)
        z = self.zero.repeat_interleave(self.group, dim=1)
        full = (self.q.float() - 8) * s + z  # [N, K]
        n, k = full.shape
        return full.reshape(n, self.input_repeat, k // self.input_repeat).sum(dim=1)

    @property
    def shape(self) -> tuple[int, int]:
        """[N, K] of the matrix it stands for (the input's width)."""
        n, k = self.q.shape
        return n, k // self.input_repeat


class PackedInt4Weight(NamedTuple):
    """An Int4Weight whose codes are already in torch's int4 CPU pack (the bytes
    `_convert_weight_to_int4pack_for_cpu` makes of them on this CPU): a GGUF's blocks packed in
    one pass (`GGUFWeights.torch_pack`), its codes never a tensor."""

    packed: torch.Tensor  # [N, K / 2] uint8
    scales_zeros: torch.Tensor  # [K / group, N, 2] bf16: the kernel's (Int4Weight's, rounded)
    group: int
    input_repeat: int = 1

    @property
    def shape(self) -> tuple[int, int]:
        n, half = self.packed.shape
        return n, 2 * half // self.input_repeat


QuantWeight = Int8Weight | Int4Weight
AnyQuantWeight = TypeVar("AnyQuantWeight", Int8Weight, Int4Weight)  # the kind given is returned
FUSE_ERROR = "cannot fuse int4 weights of different layouts, or with int8 ones"


# Kernels read scales (and zeros) in bf16 (`quant_linear.KERNEL_DTYPE`): a quantizer rounds them
# to bf16 first and codes against the rounded values. Coding against fp32 scales and rounding
# afterwards scaled every output channel by its scale's rounding error (up to 2^-9), a gain error
# the whole row shares: on the embedded model that alone cost +0.3% perplexity with int8.
_SCALE_DTYPE = torch.bfloat16
# Per-row int8 scale: max|w| / 127 shrunk by the factor, of these, with the least squared error
# (a clipped outlier costs less than a coarser step for the whole row): -0.1% perplexity.
_INT8_CLIP = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-channel int8 of `w` [N, K] (computed in fp32)."""
    w = w.detach().float()
    amax = w.abs().amax(dim=1).clamp_min(1e-12)
    best_scale, best_err = None, None
    for clip in _INT8_CLIP:
        scale = (clip * amax / 127.0).to(_SCALE_DTYPE).float()
        err = _int8_codes(w, scale).float().mul_(scale[:, None]).sub_(w).square_().sum(dim=1)
        if best_scale is None or best_err is None:
            best_scale, best_err = scale, err
        else:
            better = err < best_err
            best_scale = torch.where(better, scale, best_scale)
            best_err = torch.minimum(err, best_err)
    assert best_scale is not None
    return Int8Weight(_int8_codes(w, best_scale), best_scale)


def _int8_codes(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)


def quantize_int4(w: torch.Tensor, group: int) -> Int4Weight:
    """Asymmetric group-wise int4 of `w` [N, K]: each group's min..max in 16 steps."""
    if group not in INT4_GROUPS:
        raise ValueError(f"int4 group must be one of {INT4_GROUPS}, got {group}")
    n, k = w.shape
    g = w.detach().float().reshape(n, k // group, group)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scale = ((hi - lo) / 15.0).clamp_min(1e-12).to(_SCALE_DTYPE).float()
    zero = (lo + 8 * scale).to(_SCALE_DTYPE).float()
    q = torch.round((g - zero[..., None]) / scale[..., None] + 8).clamp_(0, 15).to(torch.uint8)
    return Int4Weight(q.reshape(n, k), scale, zero, group)


def cat_rows(parts: Sequence[QuantWeight]) -> QuantWeight:
    """Stack weights of one kind along N (fused q/k/v, gate/up): the same rows, one matrix."""
    first = parts[0]
    if isinstance(first, Int8Weight):
        return Int8Weight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))
    int4 = [p for p in parts if isinstance(p, Int4Weight)]
    if len(int4) != len(parts):
        raise ValueError(FUSE_ERROR)
    return cat_int4_rows(int4)


def cat_int4_rows(parts: Sequence[Int4Weight]) -> Int4Weight:
    """`cat_rows` of int4 weights, which must share one layout (group, input_repeat)."""
    first = parts[0]
    layout = (first.group, first.input_repeat)
    if any((p.group, p.input_repeat) != layout for p in parts):
        raise ValueError(FUSE_ERROR)
    return Int4Weight(
        torch.cat([p.q for p in parts]),
        torch.cat([p.scale for p in parts]),
        torch.cat([p.zero for p in parts]),
        first.group,
        first.input_repeat,
    )


def permute_rows(w: AnyQuantWeight, order: torch.Tensor) -> AnyQuantWeight:
    """Rows of `w` taken in `order` (GGUF keeps Llama's q/k rows in another order than HF)."""
    if isinstance(w, Int8Weight):
        return Int8Weight(w.q[order], w.scale[order])
    return w._replace(q=w.q[order], scale=w.scale[order], zero=w.zero[order])
