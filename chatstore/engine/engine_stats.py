"""What the engine reports: queue lengths, KV pool and device prefix cache, work done.

Read by the admin endpoint and the metrics exporter (`dataclasses.asdict(engine.stats())`);
the device prefix cache is the KV store's "device tier".
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    waiting: int
    running: int
    swapped: int
    num_blocks: int
    free_blocks: int
    block_size: int
    cached_blocks: int  # device prefix cache: hashed full blocks (in use or evictable)
    cached_tokens: int
    evictable_blocks: int  # cached blocks with ref count 0 (reused when the pool needs them)
    prefix_hits: int  # full prompt blocks found in the device prefix cache
    prefix_misses: int
    prefix_evictions: int
    steps: int
    preemptions: int
    swapped_out_blocks: int
    swapped_in_blocks: int
    tokens_computed: int  # prompt + decode tokens run through the model
    tokens_generated: int
    requests_finished: int
    mean_batch_size: float  # sequences per forward step
