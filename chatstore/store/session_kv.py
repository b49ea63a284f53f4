"""One session's saved KV: the token ids of its history and their position-decoupled K and V.

    kv: [L, 2, T, Hkv, D]    L layers, K (pre-RoPE) / V, T tokens, in the storage dtype
                             (int8: [L, 2, T, Hkv, D + 2], each row with its scale: kv_quant.py)

K is kept *before* RoPE, so the same tensor is valid at whatever positions its tokens occupy when
it is loaded again (CachedAttention §3.4); `transfer/rerope.py` rotates it on the way back in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chatstore.store import kv_quant


@dataclass(frozen=True)
class SessionKey:
    tenant: str
    session_id: str

    def __str__(self) -> str:
        return f"{self.tenant}/{self.session_id}"


@dataclass(frozen=True)
class ChunkKey:
    tenant: str
    digest: str  # 32 hex chars

    def __str__(self) -> str:
        return f"{self.tenant}/{self.digest[:12]}"


@dataclass
class SessionKV:
    token_ids: list[int]
    kv: torch.Tensor  # [L, 2, T, Hkv, D], K pre-RoPE

    def __post_init__(self) -> None:
        if self.kv.dim() != 5 or self.kv.shape[1] != 2:
            raise ValueError(f"kv must be [L, 2, T, Hkv, D], got {tuple(self.kv.shape)}")
        if self.kv.shape[2] != len(self.token_ids):
            raise ValueError(
                f"kv holds {self.kv.shape[2]} tokens but {len(self.token_ids)} token ids given"
            )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_layers(self) -> int:
        return self.kv.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.dtype

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def k(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 0]  # [T, Hkv, D]

    def v(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 1]

    def prefix(self, n: int) -> SessionKV:
        return SessionKV(self.token_ids[:n], self.kv[:, :, :n])

    @property
    def quantized(self) -> bool:
        return kv_quant.is_quantized(self.kv.dtype)

    def to(self, dtype: torch.dtype, device: str | torch.device = "cpu") -> SessionKV:
        """In `dtype` on `device`: to int8 quantises, from int8 dequantises (kv_quant.py)."""
        return SessionKV(list(self.token_ids), kv_quant.convert(self.kv, dtype, device))

    def equal(self, other: SessionKV) -> bool:
        return self.token_ids == other.token_ids and torch.equal(self.kv, other.kv)


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common token prefix (how much saved KV a new prompt can reuse)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
