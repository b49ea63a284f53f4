"""The element-wise parts of a layer, fused: one pass over memory each instead of several ops.

    rms_norm        out = w * x / sqrt(mean(x^2) + eps)
    add_rms_norm    h += delta; out = rms_norm(h)       (the residual add and the next norm)
    rope_store_kv   q rotated in place; k rotated and v copied into the paged pool
    silu_mul        silu(gate) * up

Two implementations with one interface: `NativeOps` (CPU, fp32/bf16: `csrc/fused_ops.c`) and
`TorchOps` (any device: the same arithmetic as transformers' eager modules, op by op). The
native ops round in bf16 wherever torch's op-by-op arithmetic rounds, so both agree with
transformers to the same tolerance. Each C op dispatches on dtype once per call (one loop per
dtype, bf16 <-> fp32 converted vectorised); with AVX512-BF16 the rms norm's sum of squares is a bf16
dot product (exact products, fp32 sum).
"""

from __future__ import annotations

import ctypes

import torch

from chatstore.kernels.native import NATIVE_DTYPES, native_library, require_library


class TorchOps:
    """Reference implementations in torch ops (CUDA, float16, or no native build)."""

    name = "torch"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # transformers' LlamaRMSNorm: normalise in fp32, scale in the input dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    @classmethod
    def add_rms_norm(
        cls, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        h.add_(delta)
        return cls.rms_norm(h, weight, eps)

    @staticmethod
    def rope_store_kv(
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        want_kv: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k rotated [T, H*, D] and v [T, Hkv, D]; k and v also written to the pool."""
        head_dim = cos.shape[-1]
        qk = qkv[:, : (num_heads + num_kv_heads) * head_dim].view(
            -1, num_heads + num_kv_heads, head_dim
        )
        v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(-1, num_kv_heads, head_dim)
        q, k = rotate(qk, cos[:, None, :], sin[:, None, :]).split([num_heads, num_kv_heads], 1)
        flat = (-1, num_kv_heads, head_dim)
        k_cache.view(flat).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(flat).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
        return q, k, v

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, rotate-half convention: x [T, H, D], cos and sin broadcastable to it."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class NativeOps:
    """The C kernels; every tensor contiguous, on the CPU, fp32 or bf16."""

    name = "native"

    def __init__(self, lib: ctypes.CDLL | None = None) -> None:
        """`lib`: a particular build (native.fallback_library()); default: this CPU's."""
        self._lib = require_library(lib)

    @staticmethod
    def applies(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
        return (
            device.type == "cpu"
            and dtype in NATIVE_DTYPES
            and head_dim <= 512
            and native_library() is not None
        )

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        rows, width = x.shape
        self._lib.rms_norm(
            NATIVE_DTYPES[x.dtype],
            x.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            width,
            eps,
        )
        return out

    def add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """h (contiguous) += delta in place; returns rms_norm(h)."""
        delta = delta.contiguous()
        out = torch.empty_like(h)
        rows, width = h.shape
        self._lib.add_rms_norm(
            NATIVE_DTYPES[h.dtype],
            h.data_ptr(),
            delta.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            width,
            eps,
        )
        return out

    def rope_store_kv(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        want_kv: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """q rotated in place inside qkv ([T, Hq, D] view); k, v go straight into the pool.

        With `want_kv`, also the rotated k [T, Hkv, D] and a view of v, else None for both."""
        head_dim = cos.shape[-1]
        rows = qkv.shape[0]
        k_out = None
        if want_kv:
            k_out = torch.empty((rows, num_kv_heads, head_dim), dtype=qkv.dtype)
        self._lib.rope_store_kv(
            NATIVE_DTYPES[qkv.dtype],
            qkv.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            slot_mapping.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            None if k_out is None else k_out.data_ptr(),
            rows,
            num_heads,
            num_kv_heads,
            head_dim,
        )
        q = qkv[:, : num_heads * head_dim].view(rows, num_heads, head_dim)
        if k_out is None:
            return q, None, None
        v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(rows, num_kv_heads, head_dim)
        return q, k_out, v

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        rows, width = gate_up.shape
        out = torch.empty((rows, width // 2), dtype=gate_up.dtype, device=gate_up.device)
        self._lib.silu_mul(
            NATIVE_DTYPES[gate_up.dtype], gate_up.data_ptr(), out.data_ptr(), rows, width // 2
        )
        return out
