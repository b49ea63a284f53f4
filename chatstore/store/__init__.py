"""AttentionStore: each session's KV kept across turns as chunks in DRAM -> LMDB -> Redis
(CachedAttention, Store v2). Storage only: what moves KV to and from the engine is
`chatstore.transfer`. The contract the rest of chatstore codes against is `ports.py`; its values
are in `port_values.py`, `session_kv.py` and `records/record.py`. This package imports nothing,
so importing the contract loads only those.

store = attention_store.create_store(config, model.spec, model.fingerprint)  # None when off
"""
