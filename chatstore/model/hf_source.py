"""A Hugging Face model directory as the runner's weight source, tensor by tensor.

Safetensors files are opened with `safe_open` (a memory map) and each tensor is read, converted
to the compute dtype and handed over when the runner asks for it: no transformers model object
is built. A directory of `*.bin` checkpoints (older saves) is mapped with `torch.load(mmap=True)`
the same way. The config is read with transformers' `AutoConfig` (a config, not a model).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from chatstore.model.errors import ModelLoadError
from chatstore.model.spec import ModelSpec
from chatstore.model.weights import LayerTensors, RopeParameters, rope_from_hf_config

if TYPE_CHECKING:
    from safetensors import safe_open
    from transformers import PretrainedConfig


class SafetensorsWeightSource:
    def __init__(
        self,
        files: list[Path],
        config: PretrainedConfig,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        self.dtype = dtype
        self.device = torch.device(device)
        self.spec = ModelSpec.from_hf_config(config)
        self.rope: RopeParameters = rope_from_hf_config(config)
        self._where: dict[str, Path] = {}
        self._bins: dict[Path, dict[str, torch.Tensor]] = {}
        self._open: dict[Path, safe_open] = {}
        try:
            self._index(files)
        except ModelLoadError:
            raise
        except Exception as exc:  # a truncated or corrupt file: the header does not parse
            raise ModelLoadError(f"cannot load the weights in {files[0].parent}: {exc}") from exc

    def _index(self, files: list[Path]) -> None:
        from safetensors import safe_open

        for f in files:
            if f.suffix == ".safetensors":
                self._open[f] = safe_open(str(f), framework="pt")
                names = list(self._open[f].keys())
            else:
                state = torch.load(f, map_location="cpu", mmap=True, weights_only=True)
                self._bins[f] = state
                names = list(state)
            for name in names:
                self._where[name] = f

    def tensor(self, name: str) -> torch.Tensor:
        f = self._where.get(name)
        if f is None:
            raise ModelLoadError(f"cannot load the weights: no tensor {name!r}")
        try:
            raw = self._bins[f][name] if f in self._bins else self._open[f].get_tensor(name)
        except Exception as exc:
            raise ModelLoadError(f"cannot load the weights in {f}: {exc}") from exc
        assert isinstance(raw, torch.Tensor)
        return raw.to(self.device, self.dtype)

    def embeddings(self) -> torch.Tensor:
        return self.tensor("model.embed_tokens.weight")

    def final_norm(self) -> torch.Tensor:
        return self.tensor("model.norm.weight")

    def lm_head(self) -> torch.Tensor:
        if self.spec.tie_word_embeddings or "lm_head.weight" not in self._where:
            return self.embeddings()
        return self.tensor("lm_head.weight")

    def layer(self, index: int, unread: frozenset[str] = frozenset()) -> LayerTensors:
        p = f"model.layers.{index}."  # safetensors' weights are read whole: `unread` is ignored

        def get(name: str) -> torch.Tensor:
            return self.tensor(p + name)

        bias = None
        if self.spec.qkv_bias:
            bias = tuple(get(f"self_attn.{x}_proj.bias") for x in "qkv")
        return LayerTensors(
            input_norm=get("input_layernorm.weight"),
            post_norm=get("post_attention_layernorm.weight"),
            q=get("self_attn.q_proj.weight"),
            k=get("self_attn.k_proj.weight"),
            v=get("self_attn.v_proj.weight"),
            o=get("self_attn.o_proj.weight"),
            gate=get("mlp.gate_proj.weight"),
            up=get("mlp.up_proj.weight"),
            down=get("mlp.down_proj.weight"),
            qkv_bias=bias,  # type: ignore[arg-type]
            q_norm=get("self_attn.q_norm.weight") if self.spec.qk_norm else None,
            k_norm=get("self_attn.k_norm.weight") if self.spec.qk_norm else None,
        )
