"""A model as transformers builds it: for what compares with transformers or needs a Hugging Face
directory (the tests' reference forward, the benchmarks' transformers and vLLM columns). The
server never calls this: it reads its weights from the file (`weights.py`).

A GGUF becomes a Hugging Face directory once (`hf_directory`): transformers reads the file
(`from_pretrained(gguf_file=...)`: its own dequantisation to fp32, Llama's q/k rows un-permuted)
and the result is saved as safetensors, config and tokenizer under the chatstore home
(`<name>-<size>-hf-fp32`, ~4 bytes a parameter), so later runs load it in seconds.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from chatstore.model.default_model import chatstore_home, gguf_path

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from chatstore.model.loader import LoadedModel


def hf_directory(gguf: Path | None = None) -> Path:
    """A transformers fp32 directory of `gguf` (default: the embedded model), made on first use."""
    gguf = gguf or gguf_path()
    target = chatstore_home() / "models" / f"{gguf.stem}-{gguf.stat().st_size}-hf-fp32"
    if (target / ".complete").is_file():
        return target
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".hf-export-", dir=target.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # tied: safetensors refuses shared storage
        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config.pop("_name_or_path", None)
        config["architectures"] = [type(model).__name__]
        (staging / "config.json").write_text(json.dumps(config, indent=2, default=str))
        model.generation_config.save_pretrained(staging)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(staging)
        (staging / ".complete").write_text("1")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def transformers_model(
    model: LoadedModel | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> PreTrainedModel:
    """transformers' *ForCausalLM of a loaded model (default: the embedded one), in eval mode,
    in `dtype` (default: the loaded model's, else fp32)."""
    from transformers import AutoModelForCausalLM

    if model is None:
        path = hf_directory()
    elif model.gguf is not None:
        path = hf_directory(model.gguf)
    else:
        path = model.path
    dtype = dtype or (model.dtype if model is not None else torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return hf.eval().to(device)
