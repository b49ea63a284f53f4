"""A minimal generation loop over the runner: one sequence, greedy or temperature sampling.

The serving engine (continuous batching, full sampling) builds on the same pieces; this loop lets
the runner be tried and tested on its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from chatstore.engine.block_pool import BlockIdPool
from chatstore.engine.forward_batch import ForwardBatch, SequenceChunk
from chatstore.engine.runner import ModelRunner


@dataclass(frozen=True)
class GenerateOptions:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


def sample_token(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> int:
    """logits [V] -> token id: argmax at temperature 0, else a draw from softmax(logits / T)."""
    if temperature == 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def generate(
    runner: ModelRunner, pool: BlockIdPool, prompt_ids: list[int], options: GenerateOptions
) -> Iterator[int]:
    """Yield generated token ids; the blocks used are returned to the pool when the loop ends."""
    if not prompt_ids:
        raise ValueError("prompt is empty")
    block_size = runner.kv_cache.block_size
    total = len(prompt_ids) + options.max_new_tokens
    if total > runner.spec.max_context:
        raise ValueError(
            f"prompt ({len(prompt_ids)}) + max_new_tokens ({options.max_new_tokens}) exceeds "
            f"the model's context of {runner.spec.max_context} tokens"
        )
    blocks = pool.allocate((total + block_size - 1) // block_size)
    generator = None
    if options.seed is not None:
        generator = torch.Generator(device="cpu").manual_seed(options.seed)
    try:
        chunk = SequenceChunk(list(prompt_ids), 0, blocks)
        for _ in range(options.max_new_tokens):
            batch = ForwardBatch.build([chunk], block_size, runner.device)
            token = sample_token(runner.forward(batch)[0].cpu(), options.temperature, generator)
            yield token
            if token in options.stop_token_ids:
                return
            chunk = SequenceChunk([token], chunk.context_len, blocks)
    finally:
        pool.free(blocks)
