"""AttentionStore: session KV across turns as immutable chunks in DRAM -> LMDB -> Redis.

Built from config by `create_store` (None when `kv_store = "off"`). On disk, under `data_dir`:

    <data_dir>/kv.lmdb        SSD tier: one key per chunk (remembers the model fingerprint)
    <data_dir>/records.lmdb   session records, with their chunk lists (when no Redis is set)

store_wiring.py builds the parts and closes them; this file implements the ports (ports.py)
over them:

    chunks/     keys, a turn's plan, reads          sessions/  index, versions, retention,
    commit/     turn commit, writer, write-back                truncation, turn opening, removal
    tiers/      DRAM, LMDB, Redis, ChunkTiers       placement/ policies, victims, prefetch
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from chatstore.config import Config
from chatstore.model.spec import ModelSpec
from chatstore.store.chunks.plan import new_chunks_of, plan_chain
from chatstore.store.commit.turn_commit import CommitListener
from chatstore.store.events import StoreStats
from chatstore.store.port_values import HistoryRead, Listener, TurnPreparer, tokens_by_tier
from chatstore.store.ports import (
    ChunkBuilder,
    ChunkCatalog,
    ChunkText,
    HintListener,
    KVPlacement,
    KVSource,
    OpenedTurn,
    QueueLookahead,
    StoredSession,
    TurnPlan,
)
from chatstore.store.retention import Retention
from chatstore.store.session_kv import ChunkKey, SessionKey, SessionKV
from chatstore.store.sessions.index import SessionChain
from chatstore.store.sessions.removal import WAIT_SAVED_S
from chatstore.store.settings import StoreSettings
from chatstore.store.store_parts import store_stats
from chatstore.store.store_wiring import StoreWiring
from chatstore.store.tiers.base import StorageTier


class AttentionStore:
    """Implements KVSource and ChunkCatalog (ports.py), whose docs are there, and what the
    session store (session_store.py) uses besides: opening turns, retention, deletes, reports."""

    def __init__(
        self,
        settings: StoreSettings,
        spec: ModelSpec,
        fingerprint: str,
        chooser: Any = None,
        redis_client: Any = None,
    ) -> None:
        self.wiring = w = StoreWiring(
            settings, spec, fingerprint, chooser, redis_client, self._save_key
        )
        # Each part under its own name: the methods below, tests, benches and tools use them.
        self.settings, self.fingerprint, self.context = w.settings, w.fingerprint, w.context
        self.layout, self.hasher, self.events, self.index = w.layout, w.hasher, w.events, w.index
        self.sealer, self.key_watch, self.redis_breaker = w.sealer, w.key_watch, w.redis_breaker
        self.versions, self.retention, self.records = w.versions, w.retention, w.records
        self.session_placement, self.session_policy = w.session_placement, w.session_policy
        self.pins, self.tiers, self.retainer = w.pins, w.tiers, w.retainer
        self.committer, self.writer, self.persister = w.committer, w.writer, w.persister
        self.restore, self.opening, self.reader = w.restore, w.opening, w.reader
        self.prefetcher, self.removal, self.truncation = w.prefetcher, w.removal, w.truncation
        self._hint_listeners: list[HintListener] = []
        self.restore.start(background=settings.background_restore)

    @staticmethod
    def key(tenant: str, session_id: str) -> SessionKey:
        return SessionKey(tenant, session_id)

    def tier(self, name: str) -> StorageTier | None:
        return next((t for t in self.tiers.tiers if t.name == name), None)

    # -- values the ports expose ----------------------------------------------------------------

    @property
    def chunk_tokens(self) -> int:
        return self.settings.chunk_tokens

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.settings.storage_dtype

    @property
    def bytes_per_token(self) -> int:
        return self.layout.bytes_per_token

    @property
    def data_dir(self) -> Path:
        return self.settings.data_dir

    @property
    def session_lease_s(self) -> float:
        return self.settings.session_lease_s

    @property
    def replica_id(self) -> str:
        return self.settings.replica_id

    @property
    def bytes_written(self) -> int:
        return self.committer.bytes_written

    # -- placement and opening turns -----------------------------------------------------------

    def set_waiting_queue(self, queue: QueueLookahead | Callable[[], Iterable[SessionKey]]) -> None:
        self.session_placement.set_queue(queue)  # a callable: tests, no engine
        if len(self.tiers.tiers) > 1:
            self.prefetcher.start()

    def prefetch(self, tenant: str, session_id: str) -> None:
        if len(self.tiers.tiers) > 1:
            self.prefetcher.hint(self.key(tenant, session_id))

    def hint(self, tenant: str, session_id: str) -> None:
        self.prefetch(tenant, session_id)
        for listener in self._hint_listeners:
            listener(tenant, session_id)

    def add_hint_listener(self, listener: HintListener) -> None:
        self._hint_listeners.append(listener)

    def open_turn(
        self,
        tenant: str,
        session_id: str,
        prompt_ids: Sequence[int] = (),
        records_turn: bool = False,
    ) -> OpenedTurn:
        """ports.SessionKVAdmin.open_turn; records_turn: the caller records the turn's chain
        (the handle's TurnChain) with its messages, the commit does not."""
        return self.opening.open(self.key(tenant, session_id), prompt_ids, records_turn)

    def end_turn(self, opened: OpenedTurn | None) -> None:
        if opened is None:
            return
        opened.unpin()
        given_up = opened.chain.give_up() if opened.chain is not None else None
        if given_up is not None:
            self.committer.record_given_up(opened.key, given_up)

    def load_history(
        self, stored: StoredSession, start: int, end: int, opened: OpenedTurn | None
    ) -> HistoryRead:
        """ports.KVSource.load_history."""
        with self.reader.foreground():  # host memory only: no SSD, no Redis read
            got = stored.read_span(
                lambda keys, rows: self.reader.read(keys, True, rows), start, end
            )
        if opened is not None:
            opened.unpin()  # read: the parts own their rows now
        if got.reached < end and len(self.tiers.tiers) > 1:
            where = self.opening.chunk_tier(stored.chunks[got.reached // stored.chunk_tokens])
            if any(t.name == where for t in self.tiers.slow):  # below host memory: bring it up
                self.prefetcher.hint(stored.key)
        return got

    def set_retention(self, tenant: str, session_id: str, retention: Retention) -> None:
        self.retainer.set(self.key(tenant, session_id), retention)

    def kv_by_tier(self, tenant: str, session_id: str) -> dict[str, int]:
        key = self.key(tenant, session_id)
        self.restore.ensure(key)  # not restored yet: read from its record now
        chain = self.index.get(key)
        if chain is None:
            return {}
        C, n, tier_of = self.chunk_tokens, len(chain.token_ids), self.opening.chunk_tier
        return tokens_by_tier(chain.chunks, C, 0, n, tier_of)

    def placement(self, tenant: str, session_id: str) -> KVPlacement:
        return KVPlacement(self.kv_by_tier(tenant, session_id), self.bytes_per_token)

    # -- finding, reading, saving ---------------------------------------------------------------

    def find(
        self, tenant: str, session_id: str, opened: OpenedTurn | None = None
    ) -> StoredSession | None:
        return self.reader.find(self.key(tenant, session_id), opened)

    def prepare_load(
        self, tenant: str, session_id: str, opened: OpenedTurn | None
    ) -> StoredSession | None:
        return self.reader.prepare_load(self.key(tenant, session_id), opened)

    def read_chunks(
        self,
        keys: list[ChunkKey],
        count: bool = True,
        rows: Sequence[tuple[int, int] | None] | None = None,
    ) -> list[SessionKV | None]:
        return self.reader.read(keys, count, rows)

    def version(self, tenant: str, session_id: str) -> int:
        return self.versions.get(self.key(tenant, session_id))

    def tier_of(self, tenant: str, session_id: str) -> str | None:
        """The slowest tier holding a chunk of the session (waits for its pending write)."""
        self.wait_saved(tenant, session_id)
        key = self.key(tenant, session_id)
        self.restore.ensure(key)  # not restored yet: read from its record now
        return self.session_placement.session_tier(key)

    def plan_turn(
        self, tenant: str, token_ids: list[int], stored: StoredSession | None, reusable: int
    ) -> TurnPlan:
        has = self.committer.has_chunk
        return plan_chain(self.hasher, tenant, token_ids, stored, reusable, has)

    def save_turn(
        self,
        tenant: str,
        session_id: str,
        token_ids: list[int],
        stored: StoredSession | None,
        reusable: int,
        prepare: TurnPreparer,
        opened_at: float | None = None,
        opened: OpenedTurn | None = None,
    ) -> None:
        """ports.KVSource.save_turn."""
        plan = self.plan_turn(tenant, token_ids, stored, reusable)
        build, nbytes = prepare(plan)
        self.save_plan(tenant, session_id, plan, build, nbytes, opened_at, opened)

    def save_plan(
        self,
        tenant: str,
        session_id: str,
        plan: TurnPlan,
        build: ChunkBuilder,
        nbytes: int,
        opened_at: float | None = None,
        opened: OpenedTurn | None = None,
    ) -> None:
        """save_turn of a plan made already (plan_turn): tests and benchmarks that build
        their chunks from the plan themselves."""
        chain = SessionChain(list(plan.token_ids), list(plan.chain))
        key, background = self.key(tenant, session_id), self.settings.async_save
        if opened is not None:
            opened_at = opened.opened_at
        recorded_by = opened.chain if opened is not None else None
        self.committer.write_turn(
            key, chain, plan, build, nbytes, background, opened_at, recorded_by
        )

    def save(self, tenant: str, session_id: str, value: SessionKV) -> str | None:
        """Keep value as the session's whole KV (tools, tests, truncation), now; the tier its
        last chunk is in."""
        self.wait_saved(tenant, session_id)
        plan = self.plan_turn(tenant, list(value.token_ids), None, 0)
        chain = SessionChain(list(plan.token_ids), list(plan.chain))
        build = partial(new_chunks_of, plan, value)
        self.committer.write_turn(self.key(tenant, session_id), chain, plan, build, 0, False)
        return self.tiers.where(plan.chain[-1]) if plan.chain else None

    def _save_key(self, key: SessionKey, value: SessionKV) -> None:
        self.save(key.tenant, key.session_id, value)

    def add_commit_listener(self, listener: CommitListener) -> None:
        self.committer.add_listener(listener)

    def yield_to(self, idle: threading.Event) -> None:
        self.writer.idle = idle
        if self.persister is not None:
            self.persister.idle = idle

    def wait_saved(self, tenant: str, session_id: str, timeout: float = WAIT_SAVED_S) -> bool:
        return self.writer.wait(self.key(tenant, session_id), timeout)

    def flush_writes(self, timeout: float | None = None) -> bool:
        return self.writer.flush(timeout)

    def flush_persist(self, timeout: float | None = None) -> bool:
        return self.committer.flush(timeout)

    # -- removing and cutting -------------------------------------------------------------------

    def delete_session(self, tenant: str, session_id: str) -> bool:
        return self.removal.delete_session(self.key(tenant, session_id))

    def shred_tenant(self, tenant: str) -> int:
        return self.removal.shred_tenant(tenant)

    def purge_expired(self) -> list[SessionKey]:
        return self.removal.purge_expired()

    def invalidate_all(self, shared: bool = False) -> int:
        return self.removal.invalidate_all(shared)

    def fit_context(
        self,
        tenant: str,
        session_id: str | None,
        prompt_ids: list[int],
        head: int,
        tail: int,
        reserve: int = 0,
    ) -> list[int]:
        key = self.key(tenant, session_id) if session_id is not None else None
        return self.truncation.fit_context(key, prompt_ids, head, tail, reserve)

    # -- reports and lifecycle ------------------------------------------------------------------

    def stats(self) -> StoreStats:
        return store_stats(self.tiers, self.redis_breaker)

    def slow_tiers(self) -> Sequence[StorageTier]:
        """The sealed tiers (SSD, remote), for the key rotation's re-seal."""
        return list(self.tiers.slow)

    def open_failures(self) -> dict[str, int]:
        counters = self.stats().counters
        return {t.name: counters.tier(t.name).open_failures for t in self.tiers.slow}

    def add_listener(self, listener: Listener) -> None:
        self.events.add_listener(listener)

    def chunks_by_tier(self) -> dict[str, list[ChunkKey]]:
        return {t.name: list(t.keys()) for t in self.tiers.tiers}

    def describe_chunk(self, key: ChunkKey) -> ChunkText | None:
        found = self.index.describe(key, self.settings.chunk_tokens)
        return ChunkText(*found) if found is not None else None

    def close(self, flush_dram: bool = True) -> None:
        """Graceful shutdown: pending writes land, DRAM chunks are written to LMDB (so a
        restart finds them), then the tiers close (store_wiring.py has the order)."""
        self.wiring.close(flush_dram)


def create_store(
    config: Config, spec: ModelSpec, fingerprint: str, **kwargs: Any
) -> AttentionStore | None:
    """The store for this config, or None when `kv_store = "off"` (the recompute baseline)."""
    if config.kv_store == "off":
        return None
    return AttentionStore(StoreSettings.from_config(config), spec, fingerprint, **kwargs)


if TYPE_CHECKING:  # mypy checks here that the store keeps every port it promises

    def _implements_ports(store: AttentionStore) -> tuple[KVSource, ChunkCatalog]:
        return store, store
