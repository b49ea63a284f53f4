"""KV events for KV-aware routers (llm-d, NVIDIA Dynamo) in vLLM's ZMQ wire format.

BlockManager.listener ─┐                      ┌─► PUB    [topic, seq, batch]
                       ├─► KVEventPublisher ──┤
store EventLog ────────┘   (queue + thread)   └─► ROUTER replay of buffered batches

Store chunks go out as device-sized blocks on the engine's hash chain (sources.py); the topic
defaults to llm-d's `kv@<pod>@<model>` (topic.py); docs/kv-events.md is the user's page.
"""

from chatstore.kv_events.publisher import KVEventPublisher
from chatstore.kv_events.sources import EngineSource, StoreSource
from chatstore.kv_events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    external_hash,
)

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EngineSource",
    "KVEventBatch",
    "KVEventPublisher",
    "StoreSource",
    "external_hash",
]
