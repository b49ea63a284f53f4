"""Where the runner's weights come from: a small typed source, read one tensor at a time.

    ModelWeights    spec, dtype, rope; embeddings(), final_norm(), lm_head(), layer(i)
    LayerTensors    one layer's norms and projections ([out, in], the compute dtype)

Three sources implement it:

    GGUFWeightSource         a GGUF file, memory-mapped; each tensor dequantised on its own
                             (`gguf_source.py`), config and RoPE from the file's metadata
    SafetensorsWeightSource  a Hugging Face directory, tensor by tensor (`hf_source.py`)
    TransformersWeights      a transformers *ForCausalLM already built (the tests' tiny models)

A source hands out each tensor when asked and keeps none: the runner builds its projections
layer by layer, so a load never holds a second copy of the model beside the one it serves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from chatstore.model.spec import ModelSpec, rope_parameters

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class RopeParameters(NamedTuple):
    """What `engine/rope.py` computes the rotary frequencies from."""

    theta: float
    rope_type: str = "default"  # default | linear here; others through `hf_config`
    factor: float = 1.0  # linear: positions divided by it
    # GGUF's `rope_freqs` (llama.cpp stores Llama 3's scaling so): each frequency divided by it
    freq_factors: torch.Tensor | None = None
    # a Hugging Face config: transformers' own init function for the other rope types
    hf_config: PretrainedConfig | None = None


class LayerTensors(NamedTuple):
    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]
    q: torch.Tensor  # [Hq D, H]
    k: torch.Tensor  # [Hkv D, H]
    v: torch.Tensor  # [Hkv D, H]
    o: torch.Tensor  # [H, Hq D]
    gate: torch.Tensor  # [I, H]
    up: torch.Tensor  # [I, H]
    down: torch.Tensor  # [H, I]
    qkv_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # Qwen2
    q_norm: torch.Tensor | None = None  # [D], Qwen3
    k_norm: torch.Tensor | None = None  # [D]


class ModelWeights(Protocol):
    @property
    def spec(self) -> ModelSpec: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def rope(self) -> RopeParameters: ...

    def embeddings(self) -> torch.Tensor:
        """[V, H] in the compute dtype."""
        ...

    def final_norm(self) -> torch.Tensor: ...

    def lm_head(self) -> torch.Tensor:
        """[V, H]: the embeddings themselves where they are tied."""
        ...

    def layer(self, index: int, unread: frozenset[str] = frozenset()) -> LayerTensors:
        """Layer `index`'s tensors in the compute dtype. `unread`: projection roles (qkv,
        o_proj, gate_up, down) whose float weights the caller will not read (it takes them
        quantized from the file): a source may hand them as [rows, 0] placeholders and skip
        dequantising them."""
        ...


def release_file_pages(*sources: object) -> None:
    """A mapped file's pages a build has read are not read again but count in RSS while
    resident (a GGUF's whole size, on top of the weights built from it): sources that map a
    file drop them (`release_pages`); others are passed over."""
    for source in sources:
        release = getattr(source, "release_pages", None)
        if callable(release):
            release()


def rope_from_hf_config(config: PretrainedConfig) -> RopeParameters:
    params = rope_parameters(config)
    theta = params.get("rope_theta", 10000.0)
    if theta is None:  # a config that names the attribute but leaves it empty
        from chatstore.model.errors import ModelLoadError

        raise ModelLoadError("the model config has rope_theta = None")
    rope_type = str(params.get("rope_type") or "default")
    return RopeParameters(float(theta), rope_type, hf_config=config)


class TransformersWeights:
    """The weights of a transformers *ForCausalLM already in memory (tests build tiny ones)."""

    def __init__(self, hf_model: torch.nn.Module) -> None:
        self.model = hf_model
        config = hf_model.config
        self.spec = ModelSpec.from_hf_config(config)
        self.rope = rope_from_hf_config(config)  # type: ignore[arg-type]
        self.dtype = self.embeddings().dtype

    def _get(self, name: str) -> torch.Tensor:
        return self.model.get_parameter(name).detach()

    def _optional(self, name: str) -> torch.Tensor | None:
        module, _, attr = name.rpartition(".")
        try:
            value = getattr(self.model.get_submodule(module), attr, None)
        except AttributeError:  # no such module (Qwen3's q/k norms elsewhere)
            return None
        return value.detach() if isinstance(value, torch.Tensor) else None

    def embeddings(self) -> torch.Tensor:
        return self._get("model.embed_tokens.weight")

    def final_norm(self) -> torch.Tensor:
        return self._get("model.norm.weight")

    def lm_head(self) -> torch.Tensor:
        return self._get("lm_head.weight")

    def layer(self, index: int, unread: frozenset[str] = frozenset()) -> LayerTensors:
        p = f"model.layers.{index}."  # the model's tensors are in memory: `unread` saves nothing
        biases = [self._optional(f"{p}self_attn.{x}_proj.bias") for x in "qkv"]
        q, k, v = biases
        bias = (q, k, v) if q is not None and k is not None and v is not None else None
        return LayerTensors(
            input_norm=self._get(p + "input_layernorm.weight"),
            post_norm=self._get(p + "post_attention_layernorm.weight"),
            q=self._get(p + "self_attn.q_proj.weight"),
            k=self._get(p + "self_attn.k_proj.weight"),
            v=self._get(p + "self_attn.v_proj.weight"),
            o=self._get(p + "self_attn.o_proj.weight"),
            gate=self._get(p + "mlp.gate_proj.weight"),
            up=self._get(p + "mlp.up_proj.weight"),
            down=self._get(p + "mlp.down_proj.weight"),
            qkv_bias=bias,
            q_norm=self._optional(p + "self_attn.q_norm.weight"),
            k_norm=self._optional(p + "self_attn.k_norm.weight"),
        )


def as_weights(source: ModelWeights | torch.nn.Module) -> ModelWeights:
    """A weight source as it is, or a transformers model's weights through the adapter."""
    if isinstance(source, torch.nn.Module):
        return TransformersWeights(source)
    return source
