"""AttentionStore: each session's KV kept across turns as chunks in DRAM -> LMDB -> Redis
(CachedAttention, Store v2). Storage only: what moves KV to and from the engine is
`chatstore.transfer`.

store = create_store(config, model.spec, model.fingerprint)      # None when kv_store = "off"
"""

from chatstore.store.attention_store import (
    AttentionStore,
    StoreSettings,
    create_store,
)
from chatstore.store.session_kv import SessionKey, SessionKV

__all__ = [
    "AttentionStore",
    "SessionKV",
    "SessionKey",
    "StoreSettings",
    "create_store",
]
