"""GGUF's quantized blocks repacked, as integers, into `quant_weights`' int4 / int8 layouts.

A GGUF tensor of N rows by K columns holds each row as K / block blocks (ggml's layouts, as
`gguf.quants` reads them):

    Q4_0  [d f16][16 B: q0..15 in the low nibbles, q16..31 in the high]   w = d (q - 8)
    Q4_1  [d f16][m f16][16 B, as Q4_0]                                     w = d q + m
    Q4_K  [d f16][dmin f16][12 B: 8 x (6-bit sc, 6-bit mn)][128 B]  per 32: w = d sc q - dmin mn
          (the 128 B hold 4 runs of 32 B: run j has sub-block 2j low, 2j + 1 high)
    Q8_0  [d f16][32 x int8]                                                w = d q

The 4-bit codes are copied as they are, so a repacked weight computes with exactly the GGUF's
integers; only each group's scale and zero are arithmetic (int4pack's w = (q - 8) s + z):

    Q4_0  s = d,        z = 0
    Q4_1  s = d,        z = m + 8 d
    Q4_K  s = d sc,     z = 8 d sc - dmin mn

Q8_0 has one scale per 32 values, which int8pack (one scale a row) cannot hold. Its codes are
split exactly into two 4-bit halves, q = 16 hi + lo (hi = q >> 4 in -8..7, lo = q & 15), and
the tensor becomes an int4 weight over the input read twice (`input_repeat = 2`):

    w = 16 d (hi + 8 - 8) + d (lo - 8) + 8 d     first K columns: s = 16 d, z = 0, code hi + 8
                                                 last K columns:  s = d,    z = 8 d, code lo

so the product is the GGUF's own 8-bit weight, not a re-quantization of it. Scales are fp32
here; the kernels read them in the compute dtype (bf16 rounds a f16 scale to 8 bits of
mantissa: within bf16 rounding of the dequantised weight). Other types have no repacking.
"""

from __future__ import annotations

import numpy as np
import torch

from chatstore.model.quant_weights import Int4Weight

REPACKABLE = ("Q4_0", "Q4_1", "Q4_K", "Q8_0")
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q8_0": 34}
BLOCK_VALUES = {"Q4_0": 32, "Q4_1": 32, "Q4_K": 256, "Q8_0": 32}
GROUP = 32  # every repacked type has one scale and zero per 32 codes


def input_repeat(type_name: str) -> int:
    """How many times over a repacked weight reads its input (Q8_0: 2, see the module doc)."""
    return 2 if type_name == "Q8_0" else 1


def repack(type_name: str, data: np.ndarray, n: int, k: int) -> Int4Weight:
    """The GGUF tensor `data` ([N, row bytes] uint8, as gguf's reader maps it) as int4."""
    scale, zero = scales_zeros(type_name, data, n, k)
    return Int4Weight(codes(type_name, data, n, k), scale, zero, GROUP, input_repeat(type_name))


def scales_zeros(type_name: str, data: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, ...]:
    """Each group's scale and zero, fp32 [N, K * input_repeat / 32] each: read from the blocks'
    headers only (1/9 of a Q4_0 tensor's bytes), so the codes can be packed elsewhere
    (`kernels/gguf_pack.py`) without ever being a tensor here."""
    blocks = _blocks(type_name, data, n, k)
    d = _f16(blocks, 0)  # [N, blocks]
    if type_name == "Q4_0":
        return d, torch.zeros_like(d)
    if type_name == "Q4_1":
        return d, _f16(blocks, 2) + 8 * d
    if type_name == "Q8_0":
        return torch.cat([16 * d, d], dim=1), torch.cat([torch.zeros_like(d), 8 * d], dim=1)
    from gguf.quants import Q4_K  # the 6-bit scale/min unpacking, integers only

    dmin = _f16(blocks, 2)  # [N, K / 256]
    packed = np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12)
    sc, mn = (torch.from_numpy(a.astype(np.int32)) for a in Q4_K.get_scale_min(packed))
    sc = sc.reshape(n, -1, 8).float()  # [N, K / 256, 8]: one per 32 values
    mn = mn.reshape(n, -1, 8).float()
    scale = (d[..., None] * sc).reshape(n, k // 32)
    zero = (8 * d[..., None] * sc - dmin[..., None] * mn).reshape(n, k // 32)
    return scale, zero


def codes(type_name: str, data: np.ndarray, n: int, k: int) -> torch.Tensor:
    """The codes 0..15 [N, K * input_repeat] uint8 (the reference the packer is tested with,
    and what the native int4 kernel packs from)."""
    blocks = _blocks(type_name, data, n, k)
    if type_name == "Q8_0":
        q = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:])).view(torch.int8)
        q = q.reshape(n, k)
        hi = (torch.bitwise_right_shift(q, 4) + 8).to(torch.uint8)  # arithmetic: -8..7 + 8
        lo = torch.bitwise_and(q, 0x0F).to(torch.uint8)
        return torch.cat([hi, lo], dim=1)  # [N, 2K]
    head, run = {"Q4_0": (2, 16), "Q4_1": (4, 16), "Q4_K": (16, 32)}[type_name]
    return nibbles(blocks[..., head:], run).reshape(n, k)


def _blocks(type_name: str, data: np.ndarray, n: int, k: int) -> np.ndarray:
    """`data` as [N, blocks, block bytes], a view of the map (nothing copied)."""
    if type_name not in REPACKABLE:
        raise ValueError(f"no repacking for GGUF type {type_name}; supported: {REPACKABLE}")
    values = BLOCK_VALUES[type_name]
    if k % values:
        raise ValueError(f"{type_name}: K = {k} is not a multiple of its block ({values})")
    return np.asarray(data, dtype=np.uint8).reshape(n, k // values, _BLOCK_BYTES[type_name])


def _f16(blocks: np.ndarray, at: int) -> torch.Tensor:
    """The f16 field at byte `at` of every block, as fp32 [N, blocks]."""
    field = np.ascontiguousarray(blocks[..., at : at + 2]).view(np.float16)[..., 0]
    return torch.from_numpy(field.astype(np.float32))


def nibbles(qs: np.ndarray | torch.Tensor, run: int) -> torch.Tensor:
    """[..., bytes] -> [..., 2 * bytes] codes: each `run`-byte run's low nibbles, then its high.
    (numpy: its uint8 element-wise ops are ~20x faster than torch's here.)"""
    qs = qs.numpy() if isinstance(qs, torch.Tensor) else qs
    runs = qs.reshape(*qs.shape[:-1], -1, 1, run)
    out = np.concatenate([runs & 0x0F, runs >> 4], axis=-2)
    return torch.from_numpy(out).flatten(-3)
