"""TritonOps: the element-wise parts of a layer as Triton kernels, for CUDA tensors.

The same interface and rounding as `chatstore.kernels.fused_ops.NativeOps` (the CPU's C
kernels), so the runner can take either: rms_norm and add_rms_norm (`norm.py`), rope_store_kv
with q rotated in place and k left pre-RoPE in qkv (`rope_kv.py`), silu_mul (`silu.py`).
Every tensor is on one device and in one dtype (fp32, bf16 or fp16); rows are contiguous.
"""

from __future__ import annotations

from chatstore.kernels.triton.norm import add_rms_norm, rms_norm
from chatstore.kernels.triton.rope_kv import rope_store_kv
from chatstore.kernels.triton.silu import silu_mul


class TritonOps:
    name = "triton"

    rms_norm = staticmethod(rms_norm)
    add_rms_norm = staticmethod(add_rms_norm)
    rope_store_kv = staticmethod(rope_store_kv)
    silu_mul = staticmethod(silu_mul)
