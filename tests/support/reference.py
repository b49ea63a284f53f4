"""The default model as transformers builds it from the GGUF: the tests' reference forward.

The server no longer builds a transformers model (it reads the GGUF tensor by tensor); the tests
compare it with transformers' own reading of the same file: `from_pretrained(gguf_file=...)`,
which dequantises every tensor to fp32 (gguf-py) and un-permutes Llama's q/k rows itself. That
takes ~15-30 s, so the result is saved once as a safetensors directory under the chatstore home
(`reference-...`, keyed by the file's name and size) and later sessions load it in seconds.
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from pathlib import Path

import torch

from chatstore.model.default_model import chatstore_home, gguf_path


def reference_dir(gguf: Path) -> Path:
    """A transformers fp32 copy of `gguf` (made on first use)."""
    target = chatstore_home() / "models" / f"reference-{gguf.stem}-{gguf.stat().st_size}-fp32"
    if (target / ".complete").is_file():
        return target
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".reference-", dir=target.parent))
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
        (staging / ".complete").write_text("1")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


@functools.cache
def default_hf_model(dtype: torch.dtype = torch.float32):
    """transformers' *ForCausalLM of the embedded GGUF, in eval mode (one per dtype a run)."""
    from transformers import AutoModelForCausalLM

    path = reference_dir(gguf_path())
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
