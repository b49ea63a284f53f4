"""The store's parts wired together (StoreWiring): built from its settings in the order they
need one another, shut down in the order that loses nothing. The facade (attention_store.py)
holds them and implements the ports over them.

    settings ─► remote (sealer, Redis), hasher, tiers, records        (store_parts.py)
             ─► index, versions, retention, placement, policy, pins
             ─► ChunkTiers ─► committer (writer, persister) ─► restore ─► opening
             ─► reader, prefetcher, removal, truncation
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

from chatstore.model.spec import ModelSpec
from chatstore.store.chunks.keys import ChunkHasher
from chatstore.store.chunks.reader import ChunkReader
from chatstore.store.commit.turn_commit import TurnCommitter
from chatstore.store.events import EventLog
from chatstore.store.placement import ChunkPlacement, Prefetcher
from chatstore.store.placement.policies import PolicyChooser, make_policy
from chatstore.store.placement.session_placement import SessionPlacement
from chatstore.store.ports import ContextBudget
from chatstore.store.records.base import RecordStore
from chatstore.store.session_kv import ChunkKey, SessionKey, SessionKV
from chatstore.store.sessions.holds import ChunkPins
from chatstore.store.sessions.index import SessionIndex
from chatstore.store.sessions.removal import SessionRemoval
from chatstore.store.sessions.restore import IndexRestore
from chatstore.store.sessions.retention_table import RetentionTable, SessionRetention
from chatstore.store.sessions.truncation import SessionTruncation
from chatstore.store.sessions.turn_opening import TurnOpening
from chatstore.store.sessions.versions import SessionVersions
from chatstore.store.settings import StoreSettings
from chatstore.store.store_parts import build_records, build_remote, build_tiers
from chatstore.store.tiers.base import StorageTier
from chatstore.store.tiers.chunk_tiers import ChunkTiers
from chatstore.store.tiers.dram import TokenKVShape

log = logging.getLogger(__name__)


class StoreWiring:
    """save: the facade's whole-KV save (truncation writes the cut session through it)."""

    def __init__(
        self,
        settings: StoreSettings,
        spec: ModelSpec,
        fingerprint: str,
        chooser: Any,
        redis_client: Any,
        save: Callable[[SessionKey, SessionKV], None],
    ) -> None:
        if settings.chunk_tokens <= 0 or settings.chunk_tokens % settings.block_size:
            raise ValueError("chunk_tokens must be a positive multiple of block_size")
        self.settings, self.fingerprint = settings, fingerprint
        self.context = ContextBudget.of(spec.max_context, settings.max_context_tokens)
        dtype = settings.storage_dtype
        self.layout = TokenKVShape(spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype)
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        remote = build_remote(settings, redis_client)
        self.sealer, self.key_watch = remote.sealer, remote.key_watch
        # Chunk names keyed per tenant when sealing (chunks/keys.py): none guessable in a dump.
        digest_key = self.sealer.keyring.digest_key if self.sealer is not None else None
        self.hasher = ChunkHasher(fingerprint, dtype, settings.chunk_tokens, digest_key)
        self.redis_breaker = remote.breaker if remote.client is not None else None
        tiers = build_tiers(settings, self.layout, fingerprint, remote)
        self.events, self.index = EventLog(), SessionIndex()
        self.versions, self.retention = SessionVersions(), RetentionTable()
        self.session_placement = places = SessionPlacement(self.index)
        if chooser is None:
            policy = make_policy(settings.policy, [t.capacity for t in tiers])
            chooser = PolicyChooser(policy, places.queued, places.mean_session_bytes)
        self.session_policy = places.chooser = chooser
        self.records: RecordStore = build_records(settings, remote)
        self._wire_sessions(tiers, chooser, save)

    def _wire_sessions(
        self, tiers: list[StorageTier], chooser: Any, save: Callable[[SessionKey, SessionKV], None]
    ) -> None:
        """The parts that keep sessions' chunks over the tiers: commit, restore, open, read,
        remove, truncate."""
        top = tiers[0].name if tiers and tiers[0].in_memory else None
        self.pins = pins = ChunkPins()  # opened turns' chunks: never a DRAM victim
        placement = ChunkPlacement(chooser, self.index.owners_of, self.index.position_of, pins, top)
        self.tiers = ChunkTiers(tiers, placement, self.events, wanted=self._needed)
        self.session_placement.tiers = self.tiers
        lock = threading.RLock()  # the index, pending chunks, held copies
        self.retainer = SessionRetention(self.retention, self.session_placement, lock)
        touch = partial(self.session_placement.tell, "touch")
        self.committer = TurnCommitter(
            self.settings, self.fingerprint, self.index, self.tiers, self.records, lock,
            self.versions, touch,
        )  # fmt: skip
        self.writer, self.persister = self.committer.writer, self.committer.persister
        self.restore = IndexRestore(
            self.committer, self.hasher, self.versions, list(self.tiers.slow),
            self.retainer.retain, self._needed, self._restored,
        )  # fmt: skip
        self.opening = opening = TurnOpening(
            self.committer, self.session_placement, self.records, self.hasher, self.versions,
            self.retainer.retain, pins, self.restore.ensure,
        )  # fmt: skip
        self.reader = ChunkReader(self.committer, opening, self.session_placement, self.retention)
        interval = self.settings.prefetch_interval_s
        candidates = self.session_placement.prefetch_candidates
        self.prefetcher = Prefetcher(opening.prefetch_session, candidates, interval)
        places, retention = self.session_placement, self.retention
        self.removal = SessionRemoval(
            self.committer, places, retention, self.sealer, self.restore.wait
        )
        window = self.context.window
        self.truncation = SessionTruncation(self.reader, self.committer, save, window)

    def _needed(self, chunk: ChunkKey) -> bool:
        # An opened turn's pinned chunk is wanted too: a borrowed prefix's chunk (no session
        # lists it yet) may then come up into DRAM.
        return self.committer.needed(chunk) or chunk in self.pins

    def _restored(self) -> None:
        """The index is whole: the shared tier learns which of its chunks our sessions list
        (no SCAN of it)."""
        try:
            self.tiers.discover_shared(list(self.index.chunks()))
        except Exception as exc:  # TierUnavailable: found on first use instead
            log.warning("could not look up the sessions' shared chunks: %s", exc)

    def close(self, flush_dram: bool = True) -> None:
        """Graceful shutdown: pending writes land, DRAM chunks are written to LMDB (so a
        restart finds them), then the tiers close."""
        self.restore.close()
        self.prefetcher.close()
        self.writer.close()
        if self.persister is not None:
            self.persister.close(flush=flush_dram)
        if flush_dram:
            with self.committer.mutate:
                self.tiers.demote_all()
        else:
            self.tiers.drain_background()  # write-downs in flight land before the tiers close
        if self.key_watch is not None:
            self.key_watch.close()
        for tier in self.tiers.tiers:
            tier.close()
        self.records.close()
        if self.sealer is not None:
            self.sealer.keyring.store.close()
