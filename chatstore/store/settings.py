"""The store's settings, from the config: tiers' sizes, Redis, chunking, placement, persistence,
encryption at rest."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from chatstore.config import Config
from chatstore.redis_security import RedisSecurity


def default_data_dir() -> Path:
    from chatstore.model.default_model import chatstore_home

    return chatstore_home() / "data"


@dataclass(frozen=True)
class StoreSettings:
    data_dir: Path
    dram_bytes: int = 4 << 30
    ssd_bytes: int = 32 << 30
    redis_url: str = ""
    records_url: str = ""  # "" = the KV Redis (or LMDB without one), "lmdb", or a Redis URL
    redis_bytes: int = 4 << 30
    redis_cluster: bool = False
    redis_timeout_s: float = 0.25
    redis_security: RedisSecurity = field(default_factory=RedisSecurity)  # TLS, ACL user
    session_lease_s: float = 30.0
    replica_id: str = ""
    redis_breaker_failures: int = 3
    redis_breaker_reset_s: float = 5.0
    records_map_bytes: int = 1 << 30
    storage_dtype: torch.dtype = torch.float32
    session_ttl_s: int = 86400
    max_context_tokens: int = 8192
    truncation_ratio: float = 0.5
    block_size: int = 16
    policy: str = "aware"  # aware | lru | fifo
    prefetch_interval_s: float = 0.05
    async_save: bool = False  # save_turn() writes in the background (the server turns it on)
    background_restore: bool = False  # the index is restored on a thread (the server: on)
    write_buffer_bytes: int = 1 << 30
    chunk_tokens: int = 256
    persist: str = "write_back"  # write_back | write_through | off
    persist_lag_s: float = 2.0
    # Encryption at rest (sealing/): records and chunks in LMDB and Redis sealed per tenant.
    encrypt_at_rest: bool = True
    secret_key: str = field(default="", repr=False)  # master key "id:base64,..." (else a file)
    secret_key_file: str = ""  # "" = $XDG_CONFIG_HOME/chatstore/secret.key (master_key.py)

    @classmethod
    def from_config(cls, config: Config) -> StoreSettings:
        data_dir = config.data_dir or os.environ.get("CHATSTORE_DATA_DIR", "")
        return cls(
            data_dir=Path(data_dir).expanduser() if data_dir else default_data_dir(),
            dram_bytes=config.dram_bytes,
            ssd_bytes=config.ssd_bytes,
            redis_url=config.redis_url,
            records_url=config.records_url,
            redis_bytes=config.redis_bytes,
            redis_cluster=config.redis_cluster,
            redis_timeout_s=config.redis_timeout_s,
            redis_security=RedisSecurity.from_config(config),
            session_lease_s=config.session_lease_s,
            replica_id=config.replica_id,
            redis_breaker_failures=config.redis_breaker_failures,
            redis_breaker_reset_s=config.redis_breaker_reset_s,
            records_map_bytes=config.records_map_bytes,
            storage_dtype=config.storage_torch_dtype,
            session_ttl_s=config.session_ttl_s,
            max_context_tokens=config.max_context_tokens,
            truncation_ratio=config.truncation_ratio,
            block_size=config.block_size,
            policy=config.policy,
            prefetch_interval_s=config.prefetch_interval_s,
            async_save=config.async_save,
            background_restore=config.background_restore,
            write_buffer_bytes=config.write_buffer_bytes,
            chunk_tokens=config.chunk_tokens,
            persist=config.persist,
            persist_lag_s=config.persist_lag_s,
            encrypt_at_rest=config.encrypt_at_rest,
            secret_key=config.secret_key,
            secret_key_file=config.secret_key_file,
        )
