"""A transformers model written as a GGUF file by gguf-py, as llama.cpp's converter lays it out:
llama.cpp's tensor names, Llama's q/k rows interleaved per head (`permute`), the shape and RoPE
in the metadata, and a minimal byte-level vocabulary (transformers' GGUF loader wants one)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

# transformers model_type -> the GGUF architecture llama.cpp writes it as
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `LlamaModel.permute` of a q or k weight's rows."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf(model, path: Path, qtype: GGMLQuantizationType) -> Path:
    """`model` (a tiny transformers *ForCausalLM) as a GGUF: 2-D weights in `qtype`, norms and
    biases in F32."""
    config = model.config
    arch = GGUF_ARCH[config.model_type]
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    w = GGUFWriter(str(path), arch)
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    w.add_vocab_size(config.vocab_size)
    w.add_tokenizer_model("gpt2")
    tokens = [f"<{i}>" for i in range(config.vocab_size)]
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges([])
    w.add_bos_token_id(config.bos_token_id)
    w.add_eos_token_id(config.eos_token_id)
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    for name, value in state.items():
        gguf_name = _gguf_name(name)
        if gguf_name is None:
            continue
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            value = permute(value, heads if "attn_q" in gguf_name else kv_heads)
        if value.ndim == 2:
            w.add_tensor(gguf_name, quantize(value, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name, np.ascontiguousarray(value, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _gguf_name(name: str) -> str | None:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    if not name.startswith("model.layers."):
        return None
    _, _, index, rest = name.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{index}.{_NAMES[module]}.{kind}"
