"""What the engine reports: queue lengths, KV pool and device prefix cache, work done.

Read by the admin endpoint and the metrics exporter (`dataclasses.asdict(engine.stats())`);
the device prefix cache is the KV store's "device tier" (`device_tier` in the store adapter
builds that tier's line from these numbers alone).
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
    # Loading saved history KV into the pool (zeros without a KV store).
    kv_loads: int = 0  # history loads (synchronous and layer-wise)
    kv_layerwise_loads: int = 0  # of them, copied layer by layer during the forward
    kv_load_wait_s: float = 0.0  # time the forward blocked on a layer not yet copied
    kv_load_copy_s: float = 0.0  # loader-thread time spent copying into the pool
    read_buffer_layers: int = 0  # layers staged ahead per queued session (0 = no read buffer)
    read_buffer_staged: int = 0  # sessions staged before their job started
    read_buffer_hits: int = 0  # loads that found their session staged
    read_buffer_layers_used: int = 0  # layers copied from the buffer, not the tier
    read_buffer_bytes: int = 0  # held by the read buffer now
    # The pool's blocks in bytes, and the device prefix cache seen as a tier of the KV store.
    block_bytes: int = 0  # KV bytes one block holds (K and V, every layer)
    cached_sessions: int = 0  # sessions whose history is in the prefix cache (BlockManager)

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
