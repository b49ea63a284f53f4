"""A GGUF file as the runner's weight source: memory-mapped, each tensor read on its own.

The model's shape and RoPE come from the file's metadata (`{arch}.block_count`,
`.embedding_length`, `.attention.head_count`, `.rope.freq_base`, ...; no transformers config);
a tensor is dequantised (bit for bit gguf-py's `dequantize`, what transformers' GGUF loader
calls) when the runner asks for it, a slice of rows at a time straight into a tensor of the
compute dtype, so a load holds the file's map, the weights built so far and one slice in fp32:
never a dense copy of the whole model. A layer's q, k, v (and gate, up) are written into one
buffer, as row slices of it: the runner's fused projection takes it without a copy. The
quantized kernels take the file's blocks themselves (`gguf_weights.py`).

Names (llama.cpp's):

    token_embd, output_norm, output (absent: tied to token_embd), rope_freqs (Llama 3)
    blk.{i}.attn_norm, ffn_norm, attn_q/k/v (+ .bias: Qwen2), attn_q_norm/attn_k_norm (Qwen3),
    attn_output, ffn_gate, ffn_up, ffn_down

For the `llama` and `mistral` architectures attn_q and attn_k hold each head's rows interleaved
(the rotary halves as pairs); the rows are put back in Hugging Face's order as transformers does.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from chatstore.model.errors import ModelLoadError
from chatstore.model.gguf_file import GGUFFile, GGUFTensor
from chatstore.model.gguf_repack import nibbles as _nibbles
from chatstore.model.gguf_weights import unpermute_order
from chatstore.model.spec import ModelSpec
from chatstore.model.weights import LayerTensors, RopeParameters

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",  # Mistral 7B's GGUFs are `llama` too
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
PERMUTED_QK = ("llama", "mistral")  # llama.cpp interleaved each q/k head's rotary halves
ROPE_SCALINGS = ("none", "linear")
ROWS_PER_SLICE = 4096  # rows dequantised at a time: bounds the fp32 scratch of a large tensor


class GGUFWeightSource:
    def __init__(
        self,
        path: Path,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        file: GGUFFile | None = None,
    ) -> None:
        self.path = path
        self.dtype = dtype
        self.device = torch.device(device)
        self.file = file if file is not None else open_gguf(path)
        self.tensors: dict[str, GGUFTensor] = {t.name: t for t in self.file.tensors}
        self.architecture = self.file.architecture
        self.spec = spec_from_gguf(self.file, self.tensors)
        self.rope = self._rope()

    def release_pages(self) -> None:
        """The file's pages out of this process's RSS, once the runner is built."""
        self.file.release_pages()

    def embeddings(self) -> torch.Tensor:
        return self.tensor("token_embd.weight")

    def final_norm(self) -> torch.Tensor:
        return self.tensor("output_norm.weight")

    def lm_head(self) -> torch.Tensor:
        if "output.weight" in self.tensors:
            return self.tensor("output.weight")
        return self.embeddings()

    def layer(self, index: int, unread: frozenset[str] = frozenset()) -> LayerTensors:
        """`unread` roles come as [rows, 0] placeholders: not dequantised (weights.py)."""
        blk, spec = f"blk.{index}.", self.spec
        permuted = self.architecture in PERMUTED_QK
        bias = None
        if f"{blk}attn_q.bias" in self.tensors:
            bias = (
                self.tensor(f"{blk}attn_q.bias"),
                self.tensor(f"{blk}attn_k.bias"),
                self.tensor(f"{blk}attn_v.bias"),
            )
        q_norm = f"{blk}attn_q_norm.weight"
        qkv = (
            (f"{blk}attn_q.weight", spec.num_heads if permuted else None),
            (f"{blk}attn_k.weight", spec.num_kv_heads if permuted else None),
            (f"{blk}attn_v.weight", None),
        )
        q, k, v = self._stacked(*qkv, unread="qkv" in unread)
        ffn = ((f"{blk}ffn_gate.weight", None), (f"{blk}ffn_up.weight", None))
        gate, up = self._stacked(*ffn, unread="gate_up" in unread)
        o, down = f"{blk}attn_output.weight", f"{blk}ffn_down.weight"
        return LayerTensors(
            input_norm=self.tensor(f"{blk}attn_norm.weight"),
            post_norm=self.tensor(f"{blk}ffn_norm.weight"),
            q=q,
            k=k,
            v=v,
            o=self._placeholder(o) if "o_proj" in unread else self.tensor(o),
            gate=gate,
            up=up,
            down=self._placeholder(down) if "down" in unread else self.tensor(down),
            qkv_bias=bias,
            q_norm=self.tensor(q_norm) if q_norm in self.tensors else None,
            k_norm=self.tensor(f"{blk}attn_k_norm.weight") if q_norm in self.tensors else None,
        )

    def _placeholder(self, name: str) -> torch.Tensor:
        """[rows, 0]: a weight the caller takes quantized, not dequantised."""
        rows, _ = self._rows_cols(self._get(name))
        return torch.empty((rows, 0), dtype=self.dtype, device=self.device)

    def _stacked(self, *parts: tuple[str, int | None], unread: bool = False) -> list[torch.Tensor]:
        """2-D tensors of one width read into one buffer: its row slices, in order (or, where
        `unread`, their placeholders)."""
        if unread:
            return [self._placeholder(name) for name, _ in parts]
        shapes = [self._rows_cols(self._get(name)) for name, _ in parts]
        cols = {c for _, c in shapes}
        if len(cols) != 1:
            return [self.tensor(name, heads) for name, heads in parts]
        buffer = torch.empty((sum(r for r, _ in shapes), cols.pop()), dtype=self.dtype)
        views, at = [], 0
        for (name, heads), (rows, _) in zip(parts, shapes, strict=True):
            views.append(self.tensor(name, heads, out=buffer[at : at + rows]))
            at += rows
        return views

    def _get(self, name: str) -> GGUFTensor:
        t = self.tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{self.path.name} has no tensor {name!r}")
        return t

    @staticmethod
    def _rows_cols(t: GGUFTensor) -> tuple[int, int]:
        return int(np.prod(t.shape[1:], dtype=np.int64)), int(t.shape[0])

    def tensor(
        self, name: str, heads: int | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Tensor `name` dequantised into the compute dtype (rows [N, K], or a vector); with
        `heads`, a llama q/k weight's rows put back in Hugging Face's order; into `out` (a
        [N, K] slice of a buffer) where given."""
        t = self._get(name)
        rows, cols = self._rows_cols(t)
        data = np.asarray(t.data).reshape(rows, -1)
        if out is None:
            out = torch.empty((rows, cols), dtype=self.dtype)
        targets = None
        if heads is not None:  # where each file row goes: the inverse of the unpermute order
            targets = torch.argsort(unpermute_order(rows, heads))
        for start in range(0, rows, ROWS_PER_SLICE):
            stop = min(rows, start + ROWS_PER_SLICE)
            part = _dequantize(data[start:stop], t)
            if targets is None:
                out[start:stop].copy_(part)  # converts to the compute dtype on the way
            else:
                out[targets[start:stop]] = part.to(self.dtype)
        if len(t.shape) == 1:
            return out.reshape(cols).to(self.device)
        return out.to(self.device)

    def _rope(self) -> RopeParameters:
        meta, arch = self.file.metadata, self.architecture
        theta = float(_number(meta, f"{arch}.rope.freq_base", 10000.0))
        scaling = str(meta.get(f"{arch}.rope.scaling.type", "none"))
        if scaling not in ROPE_SCALINGS:
            raise ModelLoadError(
                f"{self.path.name}: rope scaling {scaling!r} is not supported; "
                f"supported: {', '.join(ROPE_SCALINGS)} (and Llama 3's rope_freqs)"
            )
        factor = float(_number(meta, f"{arch}.rope.scaling.factor", 1.0)) or 1.0
        freqs = None
        if "rope_freqs.weight" in self.tensors:
            freqs = self.tensor("rope_freqs.weight").float().reshape(-1)
        rope_type = "linear" if scaling == "linear" else "default"
        return RopeParameters(theta, rope_type, factor, freqs)


def open_gguf(path: Path) -> GGUFFile:
    try:
        return GGUFFile(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc


def _dequantize(rows: np.ndarray, t: GGUFTensor) -> torch.Tensor:
    """`rows` of tensor `t` as fp32 [rows, K]: Q4_0, Q4_1 and Q8_0 in torch (the formats of the
    default model; ~5x faster than gguf-py's numpy), every other type through gguf-py."""
    fast = _FAST.get(t.tensor_type.name)
    if fast is not None:
        block_bytes = _BLOCK_BYTES[t.tensor_type.name]
        raw = torch.from_numpy(np.array(rows, dtype=np.uint8))  # a copy: the map is read-only
        return fast(raw.reshape(rows.shape[0], -1, block_bytes)).reshape(rows.shape[0], -1)
    return torch.from_numpy(_dequantize_numpy(rows, t))


# Bit for bit gguf-py's `dequantize_blocks` (its order of fp32 operations, no fused multiply-add):
#   Q4_0  d (q - 8)      Q4_1  d q + m      Q8_0  d x
# Blocks: [rows, blocks, bytes]; d and m are f16 at bytes 0 and 2; codes as in gguf_repack.
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = blocks.view(torch.float16)[..., :1].float()
    return (_nibbles(blocks[..., 2:], 16).float() - 8) * d


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    halves = blocks.view(torch.float16)
    d, m = halves[..., :1].float(), halves[..., 1:2].float()
    return (_nibbles(blocks[..., 4:], 16).float() * d).add_(m)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = blocks.view(torch.float16)[..., :1].float()
    return blocks[..., 2:].contiguous().view(torch.int8).float() * d


_FAST = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0}


def _dequantize_numpy(rows: np.ndarray, t: GGUFTensor) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        values = dequantize(rows, t.tensor_type)
    except NotImplementedError as exc:
        raise ModelLoadError(
            f"tensor {t.name}: GGUF type {t.tensor_type.name} cannot be read ({exc})"
        ) from exc
    out = np.asarray(values, dtype=np.float32)
    return out if out.flags.writeable else out.copy()  # F32: a view of the read-only map


def _number(meta: dict[str, object], key: str, default: float) -> float:
    value = meta.get(key, default)
    return float(value) if isinstance(value, (int, float)) else default


def spec_from_gguf(file: GGUFFile, tensors: dict[str, GGUFTensor]) -> ModelSpec:
    """The model's shape from the GGUF's metadata, as transformers' GGUF loader reads it."""
    arch, meta = file.architecture, file.metadata
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}"
        )

    def need(key: str) -> int:
        value = meta.get(f"{arch}.{key}")
        if not isinstance(value, int):
            raise ModelLoadError(f"{file.path.name}: metadata {arch}.{key} is missing")
        return value

    hidden, heads = need("embedding_length"), need("attention.head_count")
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    head_dim = meta.get(f"{arch}.attention.key_length", hidden // heads)
    embd = tensors.get("token_embd.weight")
    vocab = meta.get(f"{arch}.vocab_size", int(embd.shape[1]) if embd is not None else 0)
    eos = meta.get("tokenizer.ggml.eos_token_id")
    freqs = "rope_freqs.weight" in tensors
    scaling = str(meta.get(f"{arch}.rope.scaling.type", "none"))
    return ModelSpec(
        architecture=ARCHITECTURES[arch],
        num_layers=need("block_count"),
        hidden_size=hidden,
        intermediate_size=need("feed_forward_length"),
        num_heads=heads,
        num_kv_heads=int(kv_heads) if isinstance(kv_heads, int) else heads,
        head_dim=int(head_dim) if isinstance(head_dim, int) else hidden // heads,
        vocab_size=int(vocab) if isinstance(vocab, int) else 0,
        rms_norm_eps=_number(meta, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=_number(meta, f"{arch}.rope.freq_base", 10000.0),
        rope_type="llama3" if freqs else ("linear" if scaling == "linear" else "default"),
        max_position_embeddings=need("context_length"),
        qkv_bias="blk.0.attn_q.bias" in tensors,
        tie_word_embeddings="output.weight" not in tensors,
        sliding_window=None,
        eos_token_ids=(eos,) if isinstance(eos, int) else (),
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
    )
