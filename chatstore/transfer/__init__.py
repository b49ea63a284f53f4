"""What moves KV between the engine and the store: the connector (the engine's KVConnector), the
layer loader and read buffer (the read stream), the layer saver (the write stream), and the
chunk views a load reads from. The only package that imports both `engine` and `store`.

connector = create_connector(store, runtime.kv_cache, runtime.runner.rope)
"""

from __future__ import annotations

from chatstore.engine.kv_cache import PagedKVCache
from chatstore.engine.kv_connector import KVConnector, NullConnector
from chatstore.engine.rope import RotaryEmbedding
from chatstore.store.ports import KVSource
from chatstore.transfer.connector import StoreConnector

__all__ = ["StoreConnector", "create_connector"]


def create_connector(
    store: KVSource | None,
    kv_cache: PagedKVCache,
    rope: RotaryEmbedding,
    read_buffer_layers: int = 0,
    read_buffer_bytes: int = 512 << 20,
    read_buffer_queue: str = "auto",
) -> KVConnector:
    """StoreConnector over `store`, or the recompute baseline (NullConnector) when it is None.
    read_buffer_queue: stage queued sessions too ("on"), only hinted ones ("off"), or "auto"
    (queued ones only when the pool is on a GPU)."""
    if store is None:
        return NullConnector()
    if read_buffer_layers < 0:  # -1: every layer
        read_buffer_layers = kv_cache.spec.num_layers
    return StoreConnector(
        store,
        kv_cache,
        rope,
        read_buffer_layers=read_buffer_layers,
        read_buffer_bytes=read_buffer_bytes,
        stage_queued={"on": True, "off": False}.get(read_buffer_queue),
    )
