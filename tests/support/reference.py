"""The default model as transformers builds it from the GGUF: the tests' reference forward.

The server no longer builds a transformers model (it reads the GGUF tensor by tensor); the tests
compare it with transformers' own reading of the same file (`model/hf_export.py`:
`from_pretrained(gguf_file=...)`, which dequantises every tensor to fp32 and un-permutes Llama's
q/k rows itself, saved once under the chatstore home so later runs load it in seconds).
"""

from __future__ import annotations

import functools

import torch

from chatstore.model.hf_export import transformers_model


@functools.cache
def default_hf_model(dtype: torch.dtype = torch.float32):
    """transformers' *ForCausalLM of the embedded GGUF, in eval mode (one per dtype a run)."""
    return transformers_model(dtype=dtype)
