"""The shape of a Llama-family model, read once from its Hugging Face config."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

from chatstore.model.errors import ModelLoadError

# Architectures whose forward our runner reproduces: Qwen2 differs from Llama only by q/k/v
# bias, Qwen3 by an RMSNorm over each q and k head before RoPE (`qk_norm`).
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str
    max_position_embeddings: int
    qkv_bias: bool
    tie_word_embeddings: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    qk_norm: bool = False  # Qwen3: RMSNorm of each q and k head (stored K is after it)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers, at 4 bytes an element."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4

    @property
    def max_context(self) -> int:
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def fingerprint(self, weights_digest: str, dtype: str) -> str:
        """Model + weights + KV dtype: saved KV of another fingerprint is never reused."""
        fields = asdict(self)
        if not self.qk_norm:  # added later: absent, every earlier model's stored KV still fits
            del fields["qk_norm"]
        blob = json.dumps({"spec": fields, "weights": weights_digest, "dtype": dtype})
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelSpec:
        archs = list(getattr(config, "architectures", None) or [])
        model_type = getattr(config, "model_type", "")
        arch = archs[0] if archs else _arch_from_model_type(model_type)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {arch or model_type!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        rope = rope_parameters(config)
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        eos = config.eos_token_id
        eos_ids = (
            tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        )
        sliding = getattr(config, "sliding_window", None)
        qwen = arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
        if qwen and not getattr(config, "use_sliding_window", False):
            sliding = None
        return cls(
            architecture=arch,
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            vocab_size=config.vocab_size,
            rms_norm_eps=float(config.rms_norm_eps),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            rope_type=str(rope.get("rope_type", "default")),
            max_position_embeddings=config.max_position_embeddings,
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(getattr(config, "attention_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            sliding_window=sliding,
            eos_token_ids=eos_ids,
            qk_norm=arch == "Qwen3ForCausalLM",
        )


def _arch_from_model_type(model_type: str) -> str:
    return {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
    }.get(model_type, "")


def rope_parameters(config: Any) -> dict[str, Any]:
    """RoPE settings: `rope_parameters` (transformers 5) or `rope_theta`/`rope_scaling` (4.x)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if "rope_theta" not in params and getattr(config, "rope_theta", None) is not None:
        params["rope_theta"] = config.rope_theta
    scaling = getattr(config, "rope_scaling", None) or {}
    if "rope_type" not in params:
        params["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    return params
