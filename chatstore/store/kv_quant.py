"""int8 KV in the store (`kv_storage_dtype = int8`): each token's K (pre-RoPE) and V row of one
head is kept as int8 with its own absmax scale, packed into the row itself.

    float row  [D]         x
    int8 row   [D + 2]     q = round(x / s) in [-127, 127], then s as the two bytes of an fp16
    s = max|x| / 127, rounded *up* to fp16, so |x| / s <= 127: nothing is clipped and
    |x - q * s| <= s / 2 for every element

Why the scale rides in the row: every tier, the chunk slicing along tokens, the DRAM block
pool, truncation's cuts and the codec already move [L, 2, T, Hkv, D] tensors of one dtype;
with the scale as the row's last two bytes an int8 value is just such a tensor of width D + 2,
so no path can separate a row from its scale. For the default model (D = 64) a token costs
66 bytes per head and K/V instead of 128 in bf16: 0.516x.

Symmetric, no zero point: a zero point (min/max over 255 levels) was measured and does not pay.
It cuts the relative RMS error of the default model's rows (512 tokens of the truncation test's
text) from 1.06% to 0.76% for pre-RoPE K and from 0.63% to 0.55% for V, but the perplexity of a
continuation on restored history (bf16 compute, 900 history + 600 scored tokens, two windows)
moved +0.12% with this format and +0.18% with the zero point, against bf16 KV: noise either
way, and the zero point costs 2 more bytes a row. bench/quant_kv.py measures ppl_int8kv_pct.

`convert` is the one conversion every store path uses: float -> int8 quantises, int8 -> float
dequantises (in fp32, rounded once into the target dtype), int8 -> int8 is a copy at most, so a
value already stored is never quantised twice.
"""

from __future__ import annotations

import torch

INT8 = torch.int8
SCALE_DTYPE = torch.float16
SCALE_BYTES = 2
QMAX = 127
# Written into a stored value's header (codec.py): a reader that finds another name refuses it.
FORMAT = "int8-absmax-rowscale-f16"


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype == INT8


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one stored (token, head) row in `dtype`: D, or D + the scale's bytes."""
    return head_dim + SCALE_BYTES if is_quantized(dtype) else head_dim


def head_dim_of(packed: torch.Tensor) -> int:
    """D of an int8 tensor [..., D + 2]."""
    return packed.shape[-1] - SCALE_BYTES


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (any float dtype) -> int8 [..., D + 2], on x's device."""
    xf = x.float()
    bound = xf.abs().amax(dim=-1, keepdim=True) / QMAX
    scale = bound.to(SCALE_DTYPE)
    # fp16 may round the scale down; one step up keeps every |x| / s <= 127 (no clipping).
    scale = torch.where(
        scale.float() < bound, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale
    )
    s = scale.float()
    inverse = torch.where(s > 0, 1.0 / s, 0.0)  # per row: one multiply per element, no divide
    out = torch.empty((*x.shape[:-1], x.shape[-1] + SCALE_BYTES), dtype=INT8, device=x.device)
    out[..., : x.shape[-1]] = (xf * inverse).round_().clamp_(-QMAX, QMAX)
    out[..., x.shape[-1] :] = scale.view(INT8)
    return out


def scales(packed: torch.Tensor) -> torch.Tensor:
    """The fp16 scale of each row of an int8 tensor [..., D + 2], as [..., 1] (a view)."""
    return packed[..., head_dim_of(packed) :].view(SCALE_DTYPE)


def dequantize(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [..., D + 2] -> [..., D] in dtype: q * s in fp32 (exact: 8 x 11 significant bits),
    rounded once into dtype.

    Widen, scale in place, narrow: 65 us for one layer's K of 1K tokens (3 heads, D = 64, one
    thread), 70 us with a fresh product instead of the in-place one; one mixed-dtype torch.mul
    (int8 x fp32 into a bf16 `out`) measured anywhere from 73 to 750 us."""
    q = packed[..., : head_dim_of(packed)].float()
    return q.mul_(scales(packed).float()).to(dtype)


def convert(
    kv: torch.Tensor, dtype: torch.dtype, device: str | torch.device | None = None
) -> torch.Tensor:
    """kv in `dtype` (int8: the packed form above), on `device` (None: where it is). A tensor
    already in dtype is returned as is (moved if asked), so stored values are never requantised."""
    if kv.dtype == dtype:
        return kv if device is None else kv.to(device)
    if device is not None:
        kv = kv.to(device)  # int8 moves at half the bytes; the arithmetic runs where it lands
    if is_quantized(dtype):
        return quantize(kv)
    if is_quantized(kv.dtype):
        return dequantize(kv, dtype)
    return kv.to(dtype)


def staging_dtype(storage: torch.dtype, compute: torch.dtype) -> torch.dtype:
    """The dtype a turn's rows wait in before they become a stored chunk: the storage dtype,
    except for int8, whose rows wait in the compute dtype and are quantised when the chunk is
    built (on the store's writer thread, not the engine's: no forward pays for it)."""
    return compute if is_quantized(storage) else storage
