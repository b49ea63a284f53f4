"""What the engine reports: queue lengths, KV pool and device prefix cache, work done.

Read by the admin endpoint and the metrics exporter as one flat map (`as_dict`, where the
connector's load counters keep the names they have always been published under);
the device prefix cache is the KV store's "device tier" (`device_tier` in the store adapter
builds that tier's line from these numbers alone).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from chatstore.engine.kv_connector import LoadStats


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
    # Loading saved history KV into the pool (zeros without a KV store).
    load: LoadStats = field(default_factory=LoadStats)
    # The pool's blocks in bytes, and the device prefix cache seen as a tier of the KV store.
    block_bytes: int = 0  # KV bytes one block holds (K and V, every layer)
    cached_sessions: int = 0  # sessions whose history is in the prefix cache (BlockManager)

    def as_dict(self) -> dict[str, int | float]:
        """Every number by name, in field order, `load`'s fields spliced in where it sits:
        the /admin/cache `engine` object and the `chatstore_engine_*` gauges."""
        out: dict[str, int | float] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, LoadStats):
                out.update(dataclasses.asdict(value))
            else:
                out[f.name] = value
        return out

    @property
    def block_usage(self) -> float | None:
        """The share of the KV block pool in use; None for a pool of no blocks."""
        if not self.num_blocks:
            return None
        return (self.num_blocks - self.free_blocks) / self.num_blocks

    @property
    def kv_blocks(self) -> int:
        """Blocks holding KV: in use by a sequence, or free but still prefix-cached (a later
        request may revive them). `block_usage` counts the second kind as free, as vLLM does."""
        return self.num_blocks - self.free_blocks + self.evictable_blocks
