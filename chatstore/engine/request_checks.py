"""What a request must satisfy before it is queued: sampling parameters the vocabulary allows,
a non-empty prompt of valid token ids that leaves room in the model's context, and a KV need
(prompt + 1 token, or with kv_reservation = "max" its whole maximum length) the pool can hold.
Each failure names the request field to fix (InvalidRequestError, HTTP 400)."""

from __future__ import annotations

from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.request import InvalidRequestError, Request
from chatstore.model.spec import ModelSpec


def check_request(
    request: Request, spec: ModelSpec, config: EngineConfig, num_blocks: int, block_size: int
) -> None:
    """Raises InvalidRequestError when the engine cannot run `request`."""
    request.sampling.validate(spec.vocab_size)
    ids, vocab = request.prompt_token_ids, spec.vocab_size
    if not ids:
        raise InvalidRequestError("prompt", "is empty")
    if any(not 0 <= t < vocab for t in ids):
        raise InvalidRequestError("prompt", f"has a token id outside [0, {vocab})")
    context = spec.max_context
    if len(ids) >= context:
        raise InvalidRequestError(
            "prompt", f"{len(ids)} tokens leave no room in the model's {context}-token context"
        )
    field, need = "prompt", len(ids) + 1
    if config.kv_reservation == "max":
        field, need = "max_tokens", len(ids) + request.sampling.max_tokens
        need = max(need, config.max_model_len)
    blocks = -(-need // block_size)
    if blocks > num_blocks:
        raise InvalidRequestError(
            field,
            f"needs {blocks} KV blocks ({need} tokens); the pool has "
            f"{num_blocks} blocks of {block_size} tokens",
        )
