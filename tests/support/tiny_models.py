"""Tiny random-initialised models of each architecture, and chat prompts as token ids."""

from __future__ import annotations

import torch

TINY_ARCHS = ("llama", "mistral", "qwen2", "qwen3")


def tiny_hf_model(arch: str, seed: int = 0, **overrides):
    """A random-initialised transformers model of `arch` with tiny shapes (GQA, 2 layers)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    kwargs = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=1,
        bos_token_id=0,
        pad_token_id=0,
    )
    if arch == "mistral":
        kwargs["sliding_window"] = None
    if arch == "qwen3":
        kwargs["head_dim"] = 16  # Qwen3 names its head size (default 128), not hidden / heads
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval()
    if arch == "qwen2":
        # Qwen2 initialises q/k/v biases to zero; random ones make the bias path matter.
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    if arch == "qwen3":
        # Qwen3 initialises its q/k norms to ones; random ones make the norm weights matter.
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                torch.nn.init.normal_(norm.weight, mean=1.0, std=0.3)
    model.config.architectures = [model_cls.__name__]
    return model


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat rendered with the model's template, ready for the assistant's turn."""
    out = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(out["input_ids"])
