"""AttentionStore: each session's KV kept across turns as chunks in DRAM -> LMDB -> Redis
(CachedAttention, Store v2). Storage only: what moves KV to and from the engine is
`chatstore.transfer`. The contract the rest of chatstore codes against is `ports.py`.

store = create_store(config, model.spec, model.fingerprint)      # None when kv_store = "off"
"""

from chatstore.store.attention_store import AttentionStore, create_store
from chatstore.store.ports import (
    ChunkCatalog,
    KVSource,
    SessionKVAdmin,
    StoredSession,
    WaitingQueue,
)
from chatstore.store.session_kv import SessionKey, SessionKV
from chatstore.store.settings import StoreSettings, default_data_dir

__all__ = [
    "AttentionStore",
    "ChunkCatalog",
    "KVSource",
    "SessionKV",
    "SessionKVAdmin",
    "SessionKey",
    "StoreSettings",
    "StoredSession",
    "WaitingQueue",
    "create_store",
    "default_data_dir",
]
