"""Model loading: the embedded default (SmolLM2-135M-Instruct) or any local Llama-family dir."""

from chatstore.model.errors import ModelLoadError
from chatstore.model.loader import LoadedModel, load_model, resolve_model_dir
from chatstore.model.spec import ModelSpec

__all__ = ["LoadedModel", "ModelLoadError", "ModelSpec", "load_model", "resolve_model_dir"]
