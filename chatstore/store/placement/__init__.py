"""Which chunks sit in which tier: the session policies (policies/), the chunk victims a policy's
ranking gives (chunk_placement.py, victims.py), and the prefetch thread (prefetcher.py)."""

from chatstore.store.placement.chunk_placement import ChunkPlacement
from chatstore.store.placement.prefetcher import Prefetcher

__all__ = ["ChunkPlacement", "Prefetcher"]
