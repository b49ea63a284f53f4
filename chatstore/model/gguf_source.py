"""A GGUF file as the runner's weight source: memory-mapped, each tensor read on its own.

The model's shape and RoPE come from the file's metadata (`{arch}.block_count`,
`.embedding_length`, `.attention.head_count`, `.rope.freq_base`, ...; no transformers config);
a tensor is dequantised (gguf-py's `dequantize`, what transformers' GGUF loader calls) when the
runner asks for it, a slice of rows at a time straight into a tensor of the compute dtype, so a
load holds the file's map, the weights built so far and one slice in fp32: never a dense copy
of the whole model. The quantized kernels take the file's blocks themselves (`gguf_weights.py`).

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

    def embeddings(self) -> torch.Tensor:
        return self.tensor("token_embd.weight")

    def final_norm(self) -> torch.Tensor:
        return self.tensor("output_norm.weight")

    def lm_head(self) -> torch.Tensor:
        if "output.weight" in self.tensors:
            return self.tensor("output.weight")
        return self.embeddings()

    def layer(self, index: int) -> LayerTensors:
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
        return LayerTensors(
            input_norm=self.tensor(f"{blk}attn_norm.weight"),
            post_norm=self.tensor(f"{blk}ffn_norm.weight"),
            q=self.tensor(f"{blk}attn_q.weight", spec.num_heads if permuted else None),
            k=self.tensor(f"{blk}attn_k.weight", spec.num_kv_heads if permuted else None),
            v=self.tensor(f"{blk}attn_v.weight"),
            o=self.tensor(f"{blk}attn_output.weight"),
            gate=self.tensor(f"{blk}ffn_gate.weight"),
            up=self.tensor(f"{blk}ffn_up.weight"),
            down=self.tensor(f"{blk}ffn_down.weight"),
            qkv_bias=bias,
            q_norm=self.tensor(q_norm) if q_norm in self.tensors else None,
            k_norm=self.tensor(f"{blk}attn_k_norm.weight") if q_norm in self.tensors else None,
        )

    def tensor(self, name: str, heads: int | None = None) -> torch.Tensor:
        """Tensor `name` dequantised into the compute dtype (rows [N, K], or a vector); with
        `heads`, a llama q/k weight's rows put back in Hugging Face's order."""
        t = self.tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{self.path.name} has no tensor {name!r}")
        rows = int(np.prod(t.shape[1:], dtype=np.int64))
        cols = int(t.shape[0])
        data = np.asarray(t.data).reshape(rows, -1)
        out = torch.empty((rows, cols), dtype=self.dtype)
        targets = None
        if heads is not None:  # where each file row goes: the inverse of the unpermute order
            targets = torch.argsort(unpermute_order(rows, heads))
        for start in range(0, rows, ROWS_PER_SLICE):
            stop = min(rows, start + ROWS_PER_SLICE)
            part = torch.from_numpy(_dequantize(data[start:stop], t)).to(self.dtype)
            if targets is None:
                out[start:stop] = part
            else:
                out[targets[start:stop]] = part
        shape = tuple(int(d) for d in reversed(t.shape))  # outermost first
        return out.reshape(shape).to(self.device)

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


def _dequantize(rows: np.ndarray, t: GGUFTensor) -> np.ndarray:
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
