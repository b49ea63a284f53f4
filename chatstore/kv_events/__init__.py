"""KV events for KV-aware routers (llm-d, NVIDIA Dynamo) in vLLM's ZMQ wire format.

BlockManager.listener ─┐                      ┌─► PUB    [topic, seq, batch]
                       ├─► KVEventPublisher ──┤
store EventLog ────────┘   (queue + thread)   └─► ROUTER replay of buffered batches
"""

from chatstore.kv_events.publisher import KVEventPublisher
from chatstore.kv_events.sources import EngineSource, StoreSource
from chatstore.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, external_hash

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EngineSource",
    "KVEventPublisher",
    "StoreSource",
    "external_hash",
]
