"""Rotary position embedding from explicit positions (HF's rotate-half convention).

Positions are explicit because stored KV is position-decoupled: K is saved before RoPE and rotated
at whatever positions its tokens occupy when it is loaded again.
"""

from __future__ import annotations

import torch

from chatstore.kernels.fused_ops import rotate
from chatstore.model.errors import ModelLoadError
from chatstore.model.weights import RopeParameters

# Rope types whose frequencies depend on the sequence length cannot be precomputed once.
_DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


class RotaryEmbedding:
    def __init__(self, rope: RopeParameters, head_dim: int, device: torch.device) -> None:
        """Frequencies from the weight source's RoPE parameters: computed here for the default
        and linear types (and a GGUF's `rope_freqs`, Llama 3's scaling as llama.cpp stores it),
        by transformers' own init function for the other types of a Hugging Face config."""
        if rope.rope_type in _DYNAMIC_ROPE_TYPES:
            raise ModelLoadError(f"rope type {rope.rope_type!r} is not supported")
        self.scaling = 1.0
        if rope.rope_type == "default" or (rope.rope_type == "linear" and rope.hf_config is None):
            exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
            inv_freq = 1.0 / (rope.theta ** exponents.to(device))
            if rope.rope_type == "linear":
                inv_freq = inv_freq / rope.factor
            if rope.freq_factors is not None:
                inv_freq = inv_freq / rope.freq_factors.to(device, torch.float32)
            self.inv_freq = inv_freq
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope.rope_type not in ROPE_INIT_FUNCTIONS or rope.hf_config is None:
                raise ModelLoadError(f"rope type {rope.rope_type!r} is not supported")
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope.rope_type](rope.hf_config, device)
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
