"""Build what the API serves from a Config: model runtime, AttentionStore, connector, engine.

runtime = create_runtime(config)                 model + device KV pool + runner
store   = create_store(config, spec, fingerprint)   None when kv_store = "off"
engine  = AsyncEngine(runtime, EngineConfig.from_config(config), connector(store))
store.set_waiting_queue(engine's waiting sessions)  look-ahead for eviction and prefetch
kv events (config.kv_events_endpoint)            device prefix cache + store tiers over ZMQ
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from chatstore.api.app import Backend
from chatstore.api.chat_template import ChatTemplate
from chatstore.api.store_adapter import StoreAdapter

log = logging.getLogger("chatstore")


def build_backend(config: Any, runtime: Any = None) -> Backend:
    from chatstore.engine.async_engine import AsyncEngine
    from chatstore.engine.engine_config import EngineConfig
    from chatstore.engine.runtime import create_runtime, runtime_config
    from chatstore.store import create_store
    from chatstore.transfer import create_connector

    if runtime is None:
        runtime = create_runtime(config)
    else:  # the store keeps KV in the dtype of the runtime it was handed
        config = runtime_config(config, runtime.model)
    model = runtime.model
    log.info(
        "compute dtype %s (dtype = %s), KV storage dtype %s",
        str(model.dtype).removeprefix("torch."),
        config.dtype,
        str(config.storage_torch_dtype).removeprefix("torch."),
    )
    store = create_store(config, model.spec, model.fingerprint)
    connector = create_connector(
        store,
        runtime.kv_cache,
        runtime.runner.rope,
        read_buffer_layers=config.read_buffer_layers,
        read_buffer_bytes=config.read_buffer_bytes,
        read_buffer_queue=config.read_buffer_queue,
    )
    records = None if store is not None else _records_only(config)
    engine = AsyncEngine(runtime, EngineConfig.from_config(config), connector)
    if store is not None:
        store.set_waiting_queue(engine)  # a WaitingQueue: its waiting_sessions()
    max_context = model.spec.max_context
    if store is not None:
        max_context = min(max_context, store.max_context_tokens)
    on_shutdown = []
    if config.kv_events_endpoint:
        on_shutdown.append(start_kv_events(config, engine, store))
    return Backend(
        engine=engine,
        store=StoreAdapter(store, connector, records, engine_stats=engine.stats),
        template=ChatTemplate(model.tokenizer, model.spec.eos_token_ids),
        max_context=max_context,
        vocab_size=model.spec.vocab_size,
        model_name=_model_name(config.model),
        on_shutdown=on_shutdown,
    )


def start_kv_events(config: Any, engine: Any, store: Any) -> Any:
    """Publish the device prefix cache's and the store's changes, the store's at the device
    block size (one chain for a router); the publisher's close."""
    from chatstore.kv_events import EngineSource, KVEventPublisher, StoreSource
    from chatstore.kv_events.topic import pod_name, resolve_topic

    pod = pod_name(config.kv_events_pod, config.port)
    topic = resolve_topic(config.kv_events_topic, pod, _model_name(config.model))
    publisher = KVEventPublisher(
        config.kv_events_endpoint, config.kv_events_replay_endpoint or None, topic
    )
    blocks = engine.engine.blocks
    EngineSource(publisher, blocks.block_size).attach(blocks)
    if store is not None:
        StoreSource(publisher, store, blocks.block_size).attach()
    log.info("KV events: publishing on %s, topic %r", config.kv_events_endpoint, topic)
    return publisher.close


def _records_only(config: Any) -> Any:
    """kv_store = "off" (recompute every turn): session records still need a home."""
    from chatstore.store import default_data_dir
    from chatstore.store.records import LmdbRecordStore
    from chatstore.store.sealing import sealer_for

    data_dir = config.data_dir or os.environ.get("CHATSTORE_DATA_DIR", "")
    root = Path(data_dir).expanduser() if data_dir else default_data_dir()
    sealer = sealer_for(config.encrypt_at_rest, root, config.secret_key, config.secret_key_file)
    return LmdbRecordStore(
        root / "records.lmdb",
        config.session_ttl_s,
        map_size=config.records_map_bytes,
        sealer=sealer,
    )


def _model_name(name_or_path: str) -> str:
    from chatstore.model.default_model import DEFAULT_MODEL_NAME
    from chatstore.model.loader import DEFAULT_MODEL_ALIASES

    return DEFAULT_MODEL_NAME if name_or_path in DEFAULT_MODEL_ALIASES else Path(name_or_path).name
