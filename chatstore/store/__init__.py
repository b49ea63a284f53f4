"""AttentionStore: each session's KV kept across turns in DRAM -> LMDB -> Redis (CachedAttention).

store = create_store(config, model.spec, model.fingerprint)      # None when kv_store = "off"
connector = create_connector(store, runtime.kv_cache, runtime.runner.rope)
"""

from chatstore.store.attention_store import (
    AttentionStore,
    StoreSettings,
    create_store,
    device_occupancy,
)
from chatstore.store.connector import StoreConnector, create_connector
from chatstore.store.session_kv import SessionKey, SessionKV

__all__ = [
    "AttentionStore",
    "SessionKV",
    "SessionKey",
    "StoreConnector",
    "StoreSettings",
    "create_connector",
    "create_store",
    "device_occupancy",
]
