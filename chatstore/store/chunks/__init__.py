"""A session's KV as a chain of immutable chunks: their keys (keys.py) and what a turn adds to
a stored chain (plan.py)."""

from chatstore.store.chunks.keys import ChunkHasher
from chatstore.store.port_values import chunk_span
from chatstore.store.session_kv import ChunkKey

__all__ = ["ChunkHasher", "ChunkKey", "chunk_span"]
