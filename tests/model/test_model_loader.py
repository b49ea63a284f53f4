"""Model loading: the converted default, local HF dirs, and errors that name the problem."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from chatstore.config import load_config
from chatstore.model import ModelLoadError, load_model, resolve_model_dir
from chatstore.model.default_model import default_model_dir
from tests.support.tiny_models import tiny_hf_model


def save_tiny(tmp_path: Path, arch: str = "llama") -> Path:
    model = tiny_hf_model(arch)
    path = tmp_path / arch
    model.save_pretrained(path)
    return path


def test_default_model_cache_holds_the_tokenizer_only(default_model) -> None:
    """The GGUF's tokenizer is converted once; its weights are read from the file at each load
    (no fp32 copy of the model on disk), the shape from the file's metadata."""
    path = default_model_dir()
    assert (path / "tokenizer.json").is_file() and (path / ".complete").is_file()
    assert not list(path.glob("*.safetensors")) and not (path / "config.json").exists()
    assert default_model.path == path and default_model.gguf is not None
    spec = default_model.spec
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (30, 9, 3, 64)
    assert spec.rope_theta == 100000.0 and spec.eos_token_ids == (2,)
    assert spec.kv_bytes_per_token == 46080
    assert default_model.tokenizer.chat_template


def test_local_hf_directory_loads(tmp_path: Path, default_model) -> None:
    path = save_tiny(tmp_path, "qwen2")
    with pytest.raises(ModelLoadError, match="has no tokenizer"):
        load_model(str(path))
    default_model.tokenizer.save_pretrained(path)
    loaded = load_model(str(path))
    assert loaded.spec.architecture == "Qwen2ForCausalLM" and loaded.spec.qkv_bias
    assert loaded.fingerprint != default_model.fingerprint


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "nope"))


def test_file_instead_of_directory(tmp_path: Path) -> None:
    f = tmp_path / "model.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a directory"):
        resolve_model_dir(str(f))


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        resolve_model_dir(str(tmp_path))


def test_invalid_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model(str(tmp_path))


def test_unsupported_architecture(tmp_path: Path) -> None:
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(str(tmp_path))


def test_missing_weights(tmp_path: Path) -> None:
    path = save_tiny(tmp_path)
    for f in path.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelLoadError, match="no weight files"):
        load_model(str(path))


def test_corrupt_weights(tmp_path: Path, default_model) -> None:
    path = save_tiny(tmp_path)
    default_model.tokenizer.save_pretrained(path)
    weights = next(path.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match="cannot load the weights"):
        load_model(str(path))


def test_config_env_and_overrides(tmp_path: Path) -> None:
    cfg = load_config(env={"CHATSTORE_BLOCK_SIZE": "32", "CHATSTORE_PORT": "9000"})
    assert (cfg.block_size, cfg.port, cfg.host) == (32, 9000, "127.0.0.1")
    cfg = load_config(overrides={"block_size": 8}, env={"CHATSTORE_BLOCK_SIZE": "32"})
    assert cfg.block_size == 8
    with pytest.raises(ValueError, match="CHATSTORE_PORT must be an integer"):
        load_config(env={"CHATSTORE_PORT": "eighty"})
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_config(overrides={"dtype": "float8"}, env={})
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "missing.toml", env={})


@pytest.mark.model
def test_cli_generate_answers(default_model) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "chatstore", "generate", "What is the capital of France?",
         "--max-tokens", "16"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    assert "Paris" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "chatstore", "generate", "hi", "--model", "/does/not/exist"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert bad.returncode == 1 and "does not exist" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_config_dataclass_defaults_mirror_default_toml() -> None:
    """An installed wheel has no config/ folder: the dataclass defaults must say the same."""
    import dataclasses
    import tomllib

    from chatstore.config import DEFAULT_CONFIG_FILE, Config

    with DEFAULT_CONFIG_FILE.open("rb") as fh:
        sections = tomllib.load(fh).values()
    values = {k: v for section in sections for k, v in section.items()}
    defaults = Config()
    assert {k: v for k, v in values.items() if getattr(defaults, k) != v} == {}
    fields = {f.name for f in dataclasses.fields(Config)}
    assert fields - set(values) == set(), "config keys the default file does not document"


def test_dtype_auto_resolves_by_cpu_features() -> None:
    """auto is bf16 only where the CPU computes bf16 natively; the KV store follows it."""
    from chatstore.config import cpu_has_fast_bf16, resolve_dtype

    flags = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512bw {}\n"
    assert cpu_has_fast_bf16(flags.format("avx512_bf16"))
    assert cpu_has_fast_bf16(flags.format("amx_bf16 amx_tile"))
    assert not cpu_has_fast_bf16(flags.format("avx512_vnni"))
    assert resolve_dtype("float32") == "float32" and resolve_dtype("bfloat16") == "bfloat16"
    expected = "bfloat16" if cpu_has_fast_bf16() else "float32"
    cfg = load_config(env={})
    assert cfg.dtype == "auto" and cfg.resolved_dtype == expected
    assert cfg.storage_torch_dtype == cfg.torch_dtype
    cfg = load_config(overrides={"dtype": "float32", "kv_storage_dtype": "float16"}, env={})
    assert cfg.storage_torch_dtype == torch.float16
    cfg = load_config(overrides={"kv_storage_dtype": "int8"}, env={})
    assert cfg.storage_torch_dtype == torch.int8  # quantised KV (store/kv_quant.py)
    with pytest.raises(ValueError, match="kv_storage_dtype must be one of"):
        load_config(overrides={"kv_storage_dtype": "int4"}, env={})
