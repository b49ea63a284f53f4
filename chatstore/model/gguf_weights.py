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

import numpy as np
import torch

from chatstore.kernels.gguf_pack import ROW_TYPES, gguf_to_int4_native, gguf_to_int4pack
from chatstore.kernels.int4_matmul import Int4Packed
from chatstore.kernels.native import native_library
from chatstore.kernels.weight_dequant import int4pack_layout
from chatstore.model.gguf_repack import BLOCK_VALUES, GROUP, REPACKABLE, input_repeat, repack
from chatstore.model.quant_weights import Int4Weight, PackedInt4Weight, permute_rows
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


class FileRows(NamedTuple):
    """Where a fused projection's rows lie in the mapped file (`kernels/gguf_pack.py` reads
    them): valid while the GGUFWeights that made it is alive."""

    addr: np.ndarray  # [N] int64: each output row's first byte
    kinds: np.ndarray  # [N] int8: its type (gguf_pack.ROW_TYPES)
    k_out: int  # codes a row (K, or 2 K for Q8_0's halves)
    repeat: int  # input_repeat of the weight


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

    def kernel_pack(
        self, kernel: str, role: str, layer: int | None
    ) -> PackedInt4Weight | Int4Packed | None:
        """`role` packed from the file's blocks straight into int4 `kernel`'s layout (torch |
        native: `quant_linear.int4_kernel`), or None where it cannot be."""
        return self.native_pack(role, layer) if kernel == "native" else self.torch_pack(role, layer)

    def torch_pack(self, role: str, layer: int | None) -> PackedInt4Weight | None:
        """`role`'s tensors fused and packed straight into torch's int4 CPU layout, as
        `Int4Linear` would pack `parts()` fused (the same bytes, one pass, no codes tensor);
        None where they do not fuse so (`_file_rows`), where the native kernels are missing or
        torch's layout is not known here: the caller then takes `parts()`."""
        rows = self._file_rows(role, layer)
        layout = int4pack_layout()
        if rows is None or layout is None:
            return None
        packed, scales_zeros = gguf_to_int4pack(rows.addr, rows.kinds, rows.k_out, layout)
        return PackedInt4Weight(packed, scales_zeros, GROUP, rows.repeat)

    def native_pack(self, role: str, layer: int | None) -> Int4Packed | None:
        """`torch_pack` for the native int4 kernel: `pack_int4`'s bytes of `parts()` fused."""
        rows = self._file_rows(role, layer)
        if rows is None:
            return None
        return gguf_to_int4_native(rows.addr, rows.kinds, rows.k_out, rows.repeat)

    def fuses(self, role: str, layer: int | None) -> bool:
        """Whether `role`'s tensors repack and fuse into one int4 weight the kernels take: every
        type repackable, one width that each type's blocks divide, one input_repeat (Q8_0
        rides on two int4 halves, the 4-bit types on one), rows a multiple of 16. Where they
        do, the projection is built from the file's blocks alone (`parts()` otherwise says
        which part does not)."""
        tensors = [self.tensors[name] for name, _ in self._names(role, layer)]
        types = [t.tensor_type.name for t in tensors]
        widths = {int(t.shape[0]) for t in tensors}
        repeats = {input_repeat(t) for t in types}
        if not all(t in REPACKABLE for t in types) or len(widths) != 1 or len(repeats) != 1:
            return False
        (k,) = widths
        rows = sum(int(t.shape[1]) for t in tensors)
        return rows % 16 == 0 and not any(k % BLOCK_VALUES[t] for t in types)

    def _file_rows(self, role: str, layer: int | None) -> FileRows | None:
        """Where each output row of `role` lies in the file, or None where its tensors do not
        fuse into one int4 weight (`fuses`) or there are no native kernels here."""
        if not self.fuses(role, layer) or native_library() is None:
            return None
        names = self._names(role, layer)
        tensors = [self.tensors[name] for name, _ in names]
        k, repeat = int(tensors[0].shape[0]), input_repeat(tensors[0].tensor_type.name)
        addr, kinds = [], []
        for (_, kind), t in zip(names, tensors, strict=True):
            n = int(t.shape[1])
            order = self._row_order(kind, n)
            index = np.arange(n, dtype=np.int64) if order is None else order.numpy()
            addr.append(t.data.ctypes.data + index * int(t.data.shape[1]))
            kinds.append(np.full(n, ROW_TYPES[t.tensor_type.name], dtype=np.int8))
        return FileRows(np.concatenate(addr), np.concatenate(kinds), k * repeat, repeat)

    def _row_order(self, kind: str | None, rows: int) -> torch.Tensor | None:
        """The order Llama's q/k rows are read in (see the module doc), else None."""
        if self.architecture in ("llama", "mistral") and kind in ("attn_q", "attn_k"):
            heads = self.spec.num_heads if kind == "attn_q" else self.spec.num_kv_heads
            return unpermute_order(rows, heads)
        return None

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
        order = self._row_order(kind, n)
        if order is not None:
            weight = permute_rows(weight, order)
        return GGUFPart(name, type_name, n, weight)


def unpermute_order(rows: int, heads: int) -> torch.Tensor:
    """Row order turning llama.cpp's q/k layout back into HF's: transformers'
    `_reverse_permute_weights` applied to the row indices."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(rows)
