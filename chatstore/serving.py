"""The composition root: what a server serves, built from a Config. The only module that
imports engine, store, transfer and kv_events together.

    runtime   = create_runtime(config)                   model + device KV pool + runner
    kv_store  = create_store(config, spec, fingerprint)  None when kv_store = "off"
    connector = create_connector(kv_store, ...)          moves KV between engine and store
    engine    = AsyncEngine(runtime, engine config, connector)
    kv_store.set_waiting_queue(engine)                   look-ahead for eviction and prefetch
    store     = SessionStore(records, kv_store)          the API's SessionKVAdmin (no KV
                                                         when kv_store = "off")
    events    = KVEventPublisher                         device prefix cache + store tiers over
                                                         ZMQ (config.kv_events_endpoint)

serving = build(config); app = create_app(serving, settings); ...; serving.close()
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from chatstore.api.common.chat_template import ChatTemplate
from chatstore.config import Config
from chatstore.engine.async_engine import AsyncEngine
from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.kv_connector import KVConnector
from chatstore.engine.runtime import Runtime, create_runtime, runtime_config
from chatstore.kv_events import EngineSource, KVEventPublisher, StoreSource
from chatstore.kv_events.topic import pod_name, resolve_topic
from chatstore.model.default_model import DEFAULT_MODEL_NAME
from chatstore.model.loader import DEFAULT_MODEL_ALIASES
from chatstore.store.attention_store import AttentionStore, create_store
from chatstore.store.ports import ContextBudget, SessionKVAdmin
from chatstore.store.session_store import SessionStore
from chatstore.store.settings import StoreSettings
from chatstore.store.store_parts import build_records_only
from chatstore.transfer import create_connector

log = logging.getLogger("chatstore")


@dataclass(frozen=True)
class Serving:
    """A started-or-startable engine and what it serves with (api.app.Served)."""

    engine: AsyncEngine
    store: SessionKVAdmin  # the API's view: records, leases, a turn's context, KV admin
    kv_store: AttentionStore | None  # the KV tiers behind it; None when kv_store = "off"
    connector: KVConnector
    template: ChatTemplate
    events: KVEventPublisher | None  # None without config.kv_events_endpoint
    vocab_size: int
    model_name: str  # what /v1/models lists

    def close(self) -> None:
        """After the engine has stopped: the connector's threads, the session store (its
        leases, then DRAM sessions to LMDB and the tiers), then the KV events."""
        self.connector.close()
        self.store.close()
        if self.events is not None:
            self.events.close()


def build(config: Config, runtime: Runtime | None = None) -> Serving:
    """Everything a server serves, over `runtime` when given (its model's dtype then decides
    the KV storage dtype)."""
    if runtime is None:
        runtime = create_runtime(config)
    else:
        config = runtime_config(config, runtime.model)
    model = runtime.model
    log.info(
        "compute dtype %s (dtype = %s), KV storage dtype %s",
        str(model.dtype).removeprefix("torch."),
        config.dtype,
        str(config.storage_torch_dtype).removeprefix("torch."),
    )
    kv_store = create_store(config, model.spec, model.fingerprint)
    connector: KVConnector = create_connector(
        kv_store,
        runtime.kv_cache,
        runtime.runner.rope,
        read_buffer_layers=config.read_buffer_layers,
        read_buffer_bytes=config.read_buffer_bytes,
        read_buffer_queue=config.read_buffer_queue,
    )
    engine = AsyncEngine(runtime, EngineConfig.from_config(config), connector)
    store: SessionKVAdmin
    if kv_store is not None:
        kv_store.set_waiting_queue(engine)
        store = SessionStore(kv_store.records, kv_store)
    else:
        store = records_only(config, ContextBudget.of(model.spec.max_context))
    name = model_name(config.model)
    events = start_kv_events(config, engine, kv_store, name) if config.kv_events_endpoint else None
    template = ChatTemplate(model.tokenizer, model.spec.eos_token_ids)
    vocab = model.spec.vocab_size
    return Serving(engine, store, kv_store, connector, template, events, vocab, name)


def records_only(config: Config, context: ContextBudget) -> SessionStore:
    """kv_store = "off": the session records with no KV behind them."""
    settings = StoreSettings.from_config(config)
    records = build_records_only(settings)
    lease_s, replica = config.session_lease_s, config.replica_id
    return SessionStore(
        records, context=context, lease_s=lease_s, replica_id=replica, data_dir=settings.data_dir
    )


def start_kv_events(
    config: Config, engine: AsyncEngine, kv_store: AttentionStore | None, model: str
) -> KVEventPublisher:
    """Publish the device prefix cache's and the store's changes, the store's at the device
    block size (one chain for a router)."""
    pod = pod_name(config.kv_events_pod, config.port)
    topic = resolve_topic(config.kv_events_topic, pod, model)
    publisher = KVEventPublisher(
        config.kv_events_endpoint, config.kv_events_replay_endpoint or None, topic
    )
    blocks = engine.blocks
    EngineSource(publisher, blocks.block_size).attach(blocks)
    if kv_store is not None:
        StoreSource(publisher, kv_store, blocks.block_size).attach()
    log.info("KV events: publishing on %s, topic %r", config.kv_events_endpoint, topic)
    return publisher


def model_name(name_or_path: str) -> str:
    return DEFAULT_MODEL_NAME if name_or_path in DEFAULT_MODEL_ALIASES else Path(name_or_path).name


if TYPE_CHECKING:  # mypy checks here that a Serving is what the app serves
    from chatstore.api.common.app import Served

    def _is_served(serving: Serving) -> Served:
        return serving
