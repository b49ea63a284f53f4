"""Re-RoPE: stored K is kept before RoPE (position-decoupled, CachedAttention §3.4), so it is
rotated to whatever positions its tokens occupy when loaded, and device K is rotated back before
it is stored."""

from __future__ import annotations

import torch

from chatstore.engine.rope import RotaryEmbedding, apply_rope


def rope_at(
    k_pre: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, dtype: torch.dtype
) -> torch.Tensor:
    """k_pre [T, Hkv, D] rotated to positions [T], in dtype (the runner's exact arithmetic)."""
    cos, sin = rope.cos_sin(positions, dtype)
    return apply_rope(k_pre.to(dtype), cos, sin)


def unrope(k_post: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
    """Inverse of rope_at: K back to pre-RoPE (rotation by -angle), computed in fp32."""
    cos, sin = rope.cos_sin(positions, torch.float32)
    return apply_rope(k_post.float(), cos, -sin)
