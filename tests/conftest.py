"""Shared fixtures: tiny random-initialised models of each architecture, and the real default."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
from collections.abc import Iterator

import pytest
import torch

# Every server a test starts, in process or as a child process (`chatstore serve`, `chat
# --local`, the chaos and replica harnesses), computes in float32, whatever `dtype = auto` picks
# on this CPU: no test depends on the machine's CPU kind. tests/engine/test_dtype_by_cpu.py runs auto
# under both /proc/cpuinfo answers; the bf16 tests ask for bf16 by name. A developer may still
# run the suite's servers in bf16 with CHATSTORE_DTYPE=bfloat16.
TEST_DTYPE = "float32"
os.environ.setdefault("CHATSTORE_DTYPE", TEST_DTYPE)


@pytest.fixture(scope="module", autouse=True)
def give_freed_memory_back() -> Iterator[None]:
    """After each module, hand the memory its servers freed back to the OS. A server keeps
    freed activations in the heap for reuse (engine/host_memory.py), which is right for one
    long-lived server but, in a process that builds dozens of them one after another, left
    the suite's RSS growing by ~0.9 GB a module (13 GB by the end) with nothing alive."""
    yield
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc is not None:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(libc).malloc_trim(0)


TINY_ARCHS = ("llama", "mistral", "qwen2")


def tiny_hf_model(arch: str, seed: int = 0, **overrides):
    """A random-initialised transformers model of `arch` with tiny shapes (GQA, 2 layers)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
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
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval()
    if arch == "qwen2":
        # Qwen2 initialises q/k/v biases to zero; random ones make the bias path matter.
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    model.config.architectures = [model_cls.__name__]
    return model


@pytest.fixture(scope="session")
def default_model():
    """The real embedded SmolLM2-135M-Instruct (converted once into CHATSTORE_HOME)."""
    from chatstore.model import load_model

    return load_model()


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat rendered with the model's template, ready for the assistant's turn."""
    out = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(out["input_ids"])


@pytest.fixture(scope="session")
def redis_server():
    """A real redis-server on a free loopback port, shared by the run's tests."""
    from chatstore.store.redis_server import start_local_redis

    server = start_local_redis()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server, redis_client) -> str:
    """The shared server's URL, emptied first (redis_client flushed it)."""
    return redis_server.url


@pytest.fixture
def redis_client(redis_server):
    """A client of the shared server, emptied first."""
    import redis as redis_lib

    client = redis_lib.Redis.from_url(redis_server.url)
    client.flushall()
    yield client
    client.close()
