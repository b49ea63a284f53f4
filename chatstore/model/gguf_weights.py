"""A GGUF file's projection tensors, by the runner's names, repacked where their type allows.

The runner fuses q/k/v and gate/up (`engine/runner.py`); a GGUF keeps them apart:

    qkv      blk.{i}.attn_q, attn_k, attn_v       (rows stacked in that order)
    o_proj   blk.{i}.attn_output
    gate_up  blk.{i}.ffn_gate, ffn_up
    down     blk.{i}.ffn_down
    lm_head  output, or token_embd where the embeddings are tied

For the `llama` architecture (Llama and Mistral GGUFs) llama.cpp's converter stored attn_q and
attn_k with each head's rows interleaved (the rotary halves as pairs); transformers undoes that
when it loads the file (`LlamaTensorProcessor._reverse_permute_weights`) and so do we here, by
taking the same rows in the same order, so the repacked weight matches the runner's layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from chatstore.model.gguf_repack import REPACKABLE, repack
from chatstore.model.quant_weights import Int4Weight, permute_rows
from chatstore.model.spec import ModelSpec

PARTS = {
    "qkv": ("attn_q", "attn_k", "attn_v"),
    "o_proj": ("attn_output",),
    "gate_up": ("ffn_gate", "ffn_up"),
    "down": ("ffn_down",),
}


class GGUFPart(NamedTuple):
    name: str  # the GGUF tensor's name
    type_name: str  # its ggml type (Q4_1, Q8_0, F16, ...)
    rows: int  # N: output features
    weight: Int4Weight | None  # repacked, or None where the type has no repacking


class GGUFWeights:
    def __init__(self, path: Path, spec: ModelSpec) -> None:
        from chatstore.model.gguf_file import GGUFFile

        self.path = path
        self.spec = spec
        gguf = GGUFFile(path)  # tensors only: the metadata (the tokenizer's) is not built
        self.file = gguf
        self.tensors = {t.name: t for t in gguf.tensors}
        self.architecture = gguf.architecture

    def release_pages(self) -> None:
        """The file's pages out of this process's RSS, once the projections are built."""
        self.file.release_pages()

    def type_counts(self) -> dict[str, int]:
        """How many tensors of each ggml type the file holds (for the log)."""
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        return counts

    def parts(self, role: str, layer: int | None) -> list[GGUFPart]:
        """The GGUF tensors making up projection `role` of `layer` (None for lm_head and the
        embeddings), repacked where their type allows."""
        return [self._part(name, kind) for name, kind in self._names(role, layer)]

    def types(self, role: str, layer: int | None) -> tuple[list[str], int]:
        """The ggml types of `role`'s tensors and their rows in all, without repacking."""
        tensors = [self.tensors[name] for name, _ in self._names(role, layer)]
        return [t.tensor_type.name for t in tensors], sum(int(t.shape[1]) for t in tensors)

    def _names(self, role: str, layer: int | None) -> list[tuple[str, str | None]]:
        if role == "lm_head":
            name = "output.weight" if "output.weight" in self.tensors else "token_embd.weight"
            return [(name, None)]
        if role == "embeddings":
            return [("token_embd.weight", None)]
        return [(f"blk.{layer}.{p}.weight", p) for p in PARTS[role]]

    def _part(self, name: str, kind: str | None) -> GGUFPart:
        t = self.tensors[name]
        k, n = (int(x) for x in t.shape[:2])  # GGUF lists dims innermost first: [K, N]
        type_name = t.tensor_type.name
        if type_name not in REPACKABLE:
            return GGUFPart(name, type_name, n, None)
        weight = repack(type_name, t.data, n, k)
        if self.architecture in ("llama", "mistral") and kind in ("attn_q", "attn_k"):
            heads = self.spec.num_heads if kind == "attn_q" else self.spec.num_kv_heads
            weight = permute_rows(weight, unpermute_order(n, heads))
        return GGUFPart(name, type_name, n, weight)


def unpermute_order(rows: int, heads: int) -> torch.Tensor:
    """Row order turning llama.cpp's q/k layout back into HF's: transformers'
    `_reverse_permute_weights` applied to the row indices."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(rows)
