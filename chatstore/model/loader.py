"""Load a Llama-family model from a local Hugging Face directory or GGUF file; errors say what
is wrong. The weights are a source the runner reads tensor by tensor (`weights.py`): a GGUF
(the embedded default is one) straight from the file, its shape from its metadata; a Hugging
Face directory from its safetensors. No transformers model is built. A GGUF's tokenizer is
converted once into a Hugging Face tokenizer directory (`default_model.py`), and the file stays
the model's `gguf`: the source `weights = auto | int4` repacks the quantized tensors from."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from chatstore.model.default_model import default_model_dir, gguf_model_dir, gguf_path
from chatstore.model.errors import ModelLoadError
from chatstore.model.fast_tokenizer import FastTokenizer, generic_tokenizer_config
from chatstore.model.gguf_source import GGUFWeightSource
from chatstore.model.hf_source import SafetensorsWeightSource
from chatstore.model.spec import ModelSpec
from chatstore.model.weights import ModelWeights

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

DEFAULT_MODEL_ALIASES = ("", "default", "smollm2", "SmolLM2-135M-Instruct")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


@dataclass
class LoadedModel:
    weights: ModelWeights  # what the runner reads each tensor from
    tokenizer: Any
    spec: ModelSpec
    path: Path
    dtype: torch.dtype
    fingerprint: str
    gguf: Path | None = None  # the GGUF file the weights came from, if they did


class ModelSource(NamedTuple):
    path: Path  # the Hugging Face directory: the model's, or a GGUF's converted tokenizer
    gguf: Path | None  # the GGUF file the weights are read from


def resolve_model_dir(name_or_path: str | None) -> Path:
    """The local directory for `--model`: the embedded default, a HF directory or a GGUF file."""
    return resolve_model_source(name_or_path).path


def resolve_model_source(name_or_path: str | None) -> ModelSource:
    if name_or_path is None or name_or_path in DEFAULT_MODEL_ALIASES:
        return ModelSource(default_model_dir(), gguf_path())
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(gguf_model_dir(path), path)
    if not path.is_dir():
        raise ModelLoadError(
            f"model path {path} is not a directory (expected a HF model dir or a .gguf file)"
        )
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model directory")
    return ModelSource(path, None)


def read_config(path: Path) -> PretrainedConfig:
    from transformers import AutoConfig

    try:
        json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path / 'config.json'} is not valid JSON: {exc}") from exc
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:
        raise ModelLoadError(f"cannot read the config in {path}: {exc}") from exc
    ModelSpec.from_hf_config(config)  # an unsupported architecture is refused here
    return config


def load_model(
    name_or_path: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    tokenizer: bool = True,
) -> LoadedModel:
    """The model's weight source, spec and tokenizer. `tokenizer=False` leaves the tokenizer
    None, for a caller that loads it (`load_tokenizer(model.path)`) beside the weights' build."""
    path, gguf = resolve_model_source(name_or_path)
    weights: GGUFWeightSource | SafetensorsWeightSource
    if gguf is not None:
        weights = GGUFWeightSource(gguf, dtype, device)
        weight_files = [gguf]
    else:
        config = read_config(path)
        weight_files = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
        if not weight_files:
            raise ModelLoadError(f"{path} has no weight files (*.safetensors or *.bin)")
        if not any((path / f).is_file() for f in TOKENIZER_FILES):
            raise ModelLoadError(
                f"{path} has no tokenizer (expected one of: {', '.join(TOKENIZER_FILES)})"
            )
        weights = SafetensorsWeightSource(weight_files, config, dtype, device)
    loaded = load_tokenizer(path) if tokenizer else None
    digest = _weights_digest(weight_files)
    fingerprint = weights.spec.fingerprint(digest, str(dtype).removeprefix("torch."))
    return LoadedModel(weights, loaded, weights.spec, path, dtype, fingerprint, gguf)


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase | FastTokenizer:
    """transformers' tokenizer of `path`; for a directory of the generic fast class (what a
    GGUF's conversion writes) the same behaviour without importing transformers (~1.2 s of a
    server's start: fast_tokenizer.py), unless CHATSTORE_TOKENIZER=transformers."""
    choice = os.environ.get("CHATSTORE_TOKENIZER", "auto")
    if choice not in ("auto", "transformers"):
        raise ModelLoadError(f"CHATSTORE_TOKENIZER={choice!r}: expected auto or transformers")
    try:
        config = generic_tokenizer_config(path) if choice == "auto" else None
        if config is not None:
            return FastTokenizer(path, config)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {exc}") from exc


def _weights_digest(files: list[Path]) -> str:
    """Cheap identity of the weights: names, sizes and the first MiB of each file."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(str(f.stat().st_size).encode())
        with f.open("rb") as fh:
            h.update(fh.read(1 << 20))
    return h.hexdigest()
