"""Rotary position embedding from explicit positions (HF's rotate-half convention).

Positions are explicit because stored KV is position-decoupled: K is saved before RoPE and rotated
at whatever positions its tokens occupy when it is loaded again.
"""

from __future__ import annotations

from typing import Any

import torch

from chatstore.kernels.fused_ops import rotate
from chatstore.model.errors import ModelLoadError

# Rope types whose frequencies depend on the sequence length cannot be precomputed once.
_DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


class RotaryEmbedding:
    def __init__(self, hf_config: Any, head_dim: int, device: torch.device) -> None:
        params = getattr(hf_config, "rope_parameters", None) or {}
        scaling = getattr(hf_config, "rope_scaling", None) or {}
        rope_type = params.get("rope_type") or scaling.get("rope_type") or "default"
        if rope_type in _DYNAMIC_ROPE_TYPES:
            raise ModelLoadError(f"rope type {rope_type!r} is not supported")
        if rope_type == "default":
            theta = params.get("rope_theta") or getattr(hf_config, "rope_theta", 10000.0)
            if theta is None:  # a config that names the attribute but leaves it empty
                raise ModelLoadError("the model config has rope_theta = None")
            exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
            self.inv_freq = 1.0 / (float(theta) ** exponents.to(device))
            self.scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise ModelLoadError(f"rope type {rope_type!r} is not supported")
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, device)
            self.inv_freq, self.scaling = inv_freq.float(), float(scaling)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos, sin: [T, 1, D] for positions [T]."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.scaling).to(dtype)[:, None, :]
        sin = (emb.sin() * self.scaling).to(dtype)[:, None, :]
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] rotated by the angles in cos, sin [T, 1, D]."""
    return rotate(x, cos, sin)
