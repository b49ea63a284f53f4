"""AttentionStore: session KV across turns as immutable chunks in DRAM -> LMDB -> Redis.

Built from config by `create_store` (None when `kv_store = "off"`). On disk, under `data_dir`:

    <data_dir>/kv.lmdb        SSD tier: one key per chunk (remembers the model fingerprint)
    <data_dir>/records.lmdb   session records, with their chunk lists (when no Redis is set)

A session is a chain of chunks (chunks.py): its record lists the chunk keys, the index
(session_index.py) counts who holds each chunk, the tiers (tiers/hierarchy.py) store each chunk
once. A turn stores only the chunks it completed and its new tail (`plan_turn` + `save_turn`);
a lookup (`find`) answers from memory which leading tokens are stored, and the connector reads
only the chunks beyond the device's own prefix-cache hit (`read_chunks`).

Order of a turn's save: the session's new chain is indexed at once (a lookup from now on sees
the new turn; its chunks are served from the write buffer until they land), the writer thread
then stores the new chunks, deletes the chunks nobody holds any more, and writes the record.
Every change to which chunks exist runs on the writer thread or under `_mutate`, and re-checks
references when it runs: a chunk is stored only while some session holds it and deleted only
when none does, so no interleaving of turns, deletes and truncations leaks or loses one. At
start, chunks on SSD that no record lists (a crash between the two) are deleted.

Placement: `PolicyChooser(make_policy(policy))` ranks sessions (scheduler-aware look-ahead
through `set_waiting_queue`), each session's retention priority first (retention.py, kept in
its record); `ChunkPlacement` turns that into chunk victims. The prefetch thread
moves the chunks of queued or hinted sessions up to DRAM. `persist` (write_back by default)
copies stored chunks to LMDB within `persist_lag_s`, so a restart after kill -9 is warm.

`version(tenant, session_id)` changes whenever the session's saved KV may have changed and not
when it only moves between tiers (the read buffer compares it to know if a copy is stale).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from chatstore.config import Config
from chatstore.model.spec import ModelSpec
from chatstore.store.chunks import ChunkHasher, ChunkKey, chunk_span
from chatstore.store.events import EventLog, Listener, StoreStats
from chatstore.store.persister import Persister
from chatstore.store.placement import ChunkPlacement
from chatstore.store.policy import PolicyChooser, make_policy
from chatstore.store.prefetcher import Prefetcher
from chatstore.store.records import (
    LmdbRecordStore,
    RecordStore,
    RecordStoreUnavailable,
    RedisRecordStore,
    SessionRecord,
)
from chatstore.store.retention import Retention, RetentionTable
from chatstore.store.sealing import sealer_for
from chatstore.store.sealing.shared_shreds import SharedShreds
from chatstore.store.session_index import SessionChain, SessionIndex
from chatstore.store.session_kv import SessionKey, SessionKV, common_prefix_len
from chatstore.store.tiers.base import StorageTier
from chatstore.store.tiers.breaker import CircuitBreaker
from chatstore.store.tiers.dram import DramTier, KVLayout
from chatstore.store.tiers.hierarchy import ChunkTiers
from chatstore.store.tiers.lmdb import LmdbTier
from chatstore.store.tiers.redis import RedisTier, connect_redis
from chatstore.store.tiers.redis_security import RedisSecurity
from chatstore.store.truncation import TruncationPlan, plan_truncation
from chatstore.store.turn_hold import ChunkPins, TurnHold, TurnHolds
from chatstore.store.turn_origin import TurnOrigins, tokens_by_tier
from chatstore.store.turn_plan import ChunkDelta, TurnPlan, TurnWrite, plan_chain
from chatstore.store.write_buffer import WriteBuffer

log = logging.getLogger(__name__)

WAIT_SAVED_S = 30.0  # the longest a reader waits for a session's pending write
TOMBSTONES_MAX = 100_000  # deleted sessions remembered, so late saves of old turns are dropped


def default_data_dir() -> Path:
    from chatstore.model.default_model import chatstore_home

    return chatstore_home() / "data"


@dataclass(frozen=True)
class StoreSettings:
    data_dir: Path
    dram_bytes: int = 4 << 30
    ssd_bytes: int = 32 << 30
    redis_url: str = ""
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
    write_buffer_bytes: int = 1 << 30
    chunk_tokens: int = 256
    persist: str = "write_back"  # write_back | write_through | off
    persist_lag_s: float = 2.0
    # Encryption at rest (sealing/): records and chunks in LMDB and Redis sealed per tenant.
    encrypt_at_rest: bool = True
    secret_key: str = field(default="", repr=False)  # "id:base64,..." (else the key file)
    secret_key_file: str = ""  # "" = <data_dir>/secret.key, generated on first start

    @classmethod
    def from_config(cls, config: Config) -> StoreSettings:
        data_dir = config.data_dir or os.environ.get("CHATSTORE_DATA_DIR", "")
        return cls(
            data_dir=Path(data_dir).expanduser() if data_dir else default_data_dir(),
            dram_bytes=config.dram_bytes,
            ssd_bytes=config.ssd_bytes,
            redis_url=config.redis_url,
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
            write_buffer_bytes=config.write_buffer_bytes,
            chunk_tokens=config.chunk_tokens,
            persist=config.persist,
            persist_lag_s=config.persist_lag_s,
            encrypt_at_rest=config.encrypt_at_rest,
            secret_key=config.secret_key,
            secret_key_file=config.secret_key_file,
        )


@dataclass(frozen=True)
class StoredSession:
    """What the store holds of a session: its leading tokens whose chunks are all stored."""

    key: SessionKey
    token_ids: list[int]
    chunks: list[ChunkKey]
    chunk_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def span(self, index: int) -> tuple[int, int]:
        return chunk_span(index, self.chunk_tokens, len(self.token_ids))


class AttentionStore:
    def __init__(
        self,
        settings: StoreSettings,
        spec: ModelSpec,
        fingerprint: str,
        chooser: Any = None,
        redis_client: Any = None,
    ) -> None:
        if settings.chunk_tokens <= 0 or settings.chunk_tokens % settings.block_size:
            raise ValueError("chunk_tokens must be a positive multiple of block_size")
        self.settings = settings
        self.fingerprint = fingerprint
        self.layout = KVLayout(
            spec.num_layers, spec.num_kv_heads, spec.head_dim, settings.storage_dtype
        )
        self.hasher = ChunkHasher(fingerprint, settings.storage_dtype, settings.chunk_tokens)
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        # One sealer for the records and the slow tiers: DRAM stays in the clear.
        self.sealer = sealer_for(
            settings.encrypt_at_rest,
            settings.data_dir,
            settings.secret_key,
            settings.secret_key_file,
        )
        remote = redis_client
        if remote is None and settings.redis_url:
            # One client for the KV tier and the records: every call gives up after the
            # timeout, so a hung Redis costs a bounded wait (and the tier's breaker, less).
            remote = connect_redis(
                settings.redis_url,
                settings.redis_timeout_s,
                cluster=settings.redis_cluster,
                security=settings.redis_security,
            )
        # Replicas share the shred list in Redis as they share the secret (shared_shreds.py).
        self.shared_shreds = (
            SharedShreds(remote, self.sealer.keyring)
            if remote is not None and self.sealer is not None
            else None
        )
        tiers: list[StorageTier] = []
        if settings.dram_bytes > 0:
            tiers.append(DramTier(settings.dram_bytes, self.layout, settings.block_size))
        if settings.ssd_bytes > 0:
            path = settings.data_dir / "kv.lmdb"
            tiers.append(LmdbTier(path, settings.ssd_bytes, fingerprint, sealer=self.sealer))
        # One breaker per Redis: the KV tier and the records fail (and recover) together.
        breaker = CircuitBreaker(settings.redis_breaker_failures, settings.redis_breaker_reset_s)
        self.redis_breaker = breaker if remote is not None else None
        if remote is not None and settings.redis_bytes > 0:
            s = settings
            ttl, timeout = s.session_ttl_s, s.redis_timeout_s
            tiers.append(
                RedisTier(remote, s.redis_bytes, fingerprint, ttl, timeout, breaker, self.sealer)
            )
        self.events = EventLog()
        self.index = SessionIndex()
        self._lock = threading.RLock()  # the index, pending chunks, versions
        self._mutate = threading.Lock()  # which chunks exist: writer jobs, persist, cleanup
        self._pending: dict[ChunkKey, _Memo] = {}  # chunk -> the pending turn that builds it
        self._deleted: dict[SessionKey, float] = {}  # session -> monotonic time of its deletion
        self._base_pins: dict[ChunkKey, int] = {}  # chunk -> pending turns building on it
        self._queue_source: Callable[[], Iterable[SessionKey]] = tuple
        self.retention = RetentionTable()  # per-session priority and TTL, from the records
        self.origins = TurnOrigins()  # chunk tiers as each queued turn found them
        self.pins = ChunkPins()  # chunks opened turns hold: never a DRAM victim (turn_hold.py)
        self.holds = TurnHolds()  # opened turns' holds, until the connector takes them
        self._held: dict[ChunkKey, SessionKV] = {}  # pinned chunks DRAM could not take
        self.held_bytes = 0
        if chooser is None:
            chooser = PolicyChooser(
                make_policy(settings.policy, [t.capacity for t in tiers]),
                queue=lambda: self._queue_source(),
                mean_kv_bytes=self._mean_session_bytes,
            )
        self.session_policy = chooser
        top = tiers[0].name if tiers and tiers[0].in_memory else None
        placement = ChunkPlacement(
            chooser, self.index.owners_of, self.index.position_of, self.pins, top
        )
        self.tiers = ChunkTiers(tiers, placement, self.events, wanted=self._needed)
        self.writer = WriteBuffer(self._commit, settings.write_buffer_bytes)
        self.prefetcher = Prefetcher(
            self._prefetch_session, self._prefetch_candidates, settings.prefetch_interval_s
        )
        lmdb_tier = self.tier("ssd")
        self.persister: Persister | None = None
        shared = self.tier("remote") is not None
        if settings.persist != "off" and (lmdb_tier or shared) and self.tiers.top:
            # write_through copies on the writer thread; its persister only retries refusals.
            self.persister = Persister(self._persist_chunk, settings.persist_lag_s)
        self.records: RecordStore = (
            RedisRecordStore(
                remote, settings.session_ttl_s, settings.redis_timeout_s, breaker, self.sealer
            )
            if remote is not None
            else LmdbRecordStore(
                settings.data_dir / "records.lmdb",
                settings.session_ttl_s,
                map_size=settings.records_map_bytes,
                sealer=self.sealer,
            )
        )
        self._version_clock = itertools.count(1)
        self._versions: dict[SessionKey, int] = {}
        self._epoch = 0
        self.bytes_written = 0  # chunk bytes handed to the tiers (new chunks only)
        self._restore()

    @staticmethod
    def key(tenant: str, session_id: str) -> SessionKey:
        return SessionKey(tenant, session_id)

    def tier(self, name: str) -> StorageTier | None:
        return next((t for t in self.tiers.tiers if t.name == name), None)

    # -- start: index from records, orphans out ----------------------------------------------

    def _restore(self) -> None:
        try:
            records = self.records.list_sessions()
        except RecordStoreUnavailable as exc:
            # Redis out of reach at start (down, or refusing us: a TLS certificate that does
            # not verify, a wrong password). Serve from the local tiers; sessions are found in
            # the records when Redis is back. No orphan sweep: with no records read, every
            # local chunk would look unreferenced.
            log.warning("session records unreachable at start (%s): index starts empty", exc)
            return
        for record in records:
            self._retain(record)
            chunks = getattr(record, "chunks", None) or []
            if not chunks or not record.token_ids:
                continue
            if record.fingerprint != self.fingerprint:
                # Another model's ids (the API hides them: the next turn re-renders the
                # messages); its chunks are orphans, deleted below.
                log.info("session %s was saved by another model: its KV is not reused", record.key)
                continue
            if self.hasher.num_chunks(len(record.token_ids)) != len(chunks):
                continue  # a record from another chunk size: its KV is not reused
            keys = [ChunkKey(record.tenant, d) for d in chunks]
            chain = SessionChain(list(record.token_ids), keys, record.updated_at)
            self.index.set(record.key, chain)
        orphans = 0
        for tier in self.tiers.slow:
            if tier.name == "remote":
                continue  # shared with other replicas: their chunks expire by TTL
            for key in tier.keys():  # noqa: SIM118 (a tier, not a dict)
                if not self.index.referenced(key):
                    tier.delete(key)
                    orphans += 1
        if orphans:
            log.info("deleted %d stored chunks no session references", orphans)

    # -- scheduler-aware placement --------------------------------------------------------

    def set_waiting_queue(self, source: Callable[[], Iterable[SessionKey]]) -> None:
        """The engine's waiting queue as session keys, soonest first (thread-safe callable):
        the look-ahead for eviction and for the prefetch thread, which starts now."""
        self._queue_source = source
        if len(self.tiers.tiers) > 1:
            self.prefetcher.start()

    def prefetch(self, tenant: str, session_id: str) -> None:
        """Hint: this session runs soon; move its chunks up to DRAM in the background."""
        if len(self.tiers.tiers) > 1:
            self.prefetcher.hint(self.key(tenant, session_id))

    def fetch_remote(self, tenant: str, session_id: str) -> int:
        """Open a turn: make the session's chunks readable by the engine's thread, which reads
        no remote tier, and keep them so until it has read them (turn_hold.py); how many came
        up from the remote tier. For the thread that opens a turn, before the engine queues
        it. In chain order, stopping at the first chunk that is gone or cannot be held (the
        rest is recomputed): every chunk is pinned (no DRAM eviction picks it), and one only
        Redis holds is promoted to DRAM, or kept beside it when DRAM cannot take it (a tier
        smaller than the session, or full of other turns' pinned chunks). The connector takes
        the hold at admission (`take_hold`) and releases it once read; one never taken lapses
        after HOLD_TTL_S. First it notes where each chunk is (turn_origin.py): the turn's
        cached tokens are counted by those tiers, whatever this fetch or the prefetch thread
        moves later."""
        key = self.key(tenant, session_id)
        remote = self.tier("remote") is not None and self.tiers.top is not None
        if remote:
            self._adopt(key)
        chain = self.index.get(key)
        if chain is not None:  # this turn's cached tokens count where it found them
            self.origins.note(key, {c: w for c in chain.chunks if (w := self.chunk_tier(c))})
        else:
            self.origins.drop(key)
        if not remote:
            return 0
        hold = TurnHold(key)
        moved = 0
        try:
            for chunk in chain.chunks if chain is not None else []:
                self.pins.add(chunk)  # first: from now on no eviction takes it from DRAM
                hold.chunks.append(chunk)
                came_up = self._hold_chunk(chunk)
                if came_up is None:
                    self.release_hold(TurnHold(key, [hold.chunks.pop()]))
                    break
                moved += came_up
        finally:
            for lapsed in self.holds.put(hold):
                self.release_hold(lapsed)
        return moved

    def _hold_chunk(self, chunk: ChunkKey) -> int | None:
        """Make a pinned chunk readable without the remote tier: 1 when it came up from there,
        0 when it was readable already, None when it is gone or cannot be held."""
        top = self.tiers.top
        assert top is not None
        if chunk in self._pending or chunk in self._held:
            return 0  # the write buffer's (pinned: it stays in DRAM once it lands), or held
        with self.tiers.lock:
            if top.contains(chunk):
                return 0  # pinned there now
        where = self.tiers.where(chunk)
        if where is None:
            return None
        if where != top.name and where != "remote":
            return 0  # a local tier (SSD): the engine's thread reads it there
        # Only Redis holds it, or it is on its way down from DRAM: brought up (the engine's
        # read counts the hit), into DRAM if it makes room without evicting a pinned chunk.
        value = self.tiers.get(chunk, promote=True, count=False)
        if value is None:
            return None
        with self.tiers.lock:
            in_dram = top.contains(chunk)
        if not in_dram:
            with self._lock:
                if self.held_bytes + value.nbytes > self.settings.write_buffer_bytes:
                    return None
                if chunk not in self._held:
                    self._held[chunk] = value
                    self.held_bytes += value.nbytes
            if where == "remote":
                with self.tiers.lock:
                    self.tiers.counters.bytes_up += value.nbytes
        return 1 if where == "remote" else 0

    def take_hold(self, tenant: str, session_id: str) -> TurnHold | None:
        """The hold of the session's opened turn, for the engine's admission (the taker
        releases it with `release_hold` once it has read the chunks); None if none."""
        hold, lapsed = self.holds.take(self.key(tenant, session_id))
        for old in lapsed:
            self.release_hold(old)
        return hold

    def release_hold(self, hold: TurnHold | None) -> None:
        """Unpin the hold's chunks; a held copy goes with its last pin."""
        if hold is None:
            return
        chunks, hold.chunks = hold.chunks, []  # released once, whoever asks again
        for chunk in chunks:
            if self.pins.remove(chunk):
                with self._lock:
                    value = self._held.pop(chunk, None)
                    if value is not None:
                        self.held_bytes -= value.nbytes

    def _adopt(self, key: SessionKey) -> None:
        """Take the session's chain from its shared record when another replica saved it
        after us (records and chunks in Redis): the chunks it lists that Redis holds become
        this session's history here. Skipped while a turn of ours is still being written."""
        if self.writer.is_pending(key):
            return
        try:
            record = self.records.get(key)
        except Exception as exc:  # RecordStoreUnavailable: keep what we know
            log.debug("could not read %s's record: %s", key, exc)
            return
        if record is None:
            return
        self._retain(record)  # another replica may have changed it
        if record.fingerprint != self.fingerprint or not record.chunks:
            return
        current = self.index.get(key)
        digests = [c.digest for c in current.chunks] if current is not None else []
        if digests == record.chunks:
            return
        if self.hasher.num_chunks(len(record.token_ids)) != len(record.chunks):
            return
        keys = [ChunkKey(key.tenant, d) for d in record.chunks]
        remote = self.tier("remote")
        try:
            remote.discover(keys)  # type: ignore[union-attr]
        except Exception as exc:  # TierUnavailable
            log.debug("could not look up %s's chunks: %s", key, exc)
            return
        chain = SessionChain(list(record.token_ids), keys, record.updated_at)
        with self._lock:
            freed = self.index.set(key, chain)
            self._tell_policy("touch", key)
        self._free(freed)
        self._bump_version(key)

    def chunk_tier(self, chunk: ChunkKey) -> str | None:
        """The fastest tier holding chunk; a chunk still in the write buffer, or held for an
        opened turn beside DRAM, is in host memory ("dram"); None when it is gone."""
        if chunk in self._pending or chunk in self._held:
            return "dram"
        return self.tiers.where(chunk)

    # -- retention ------------------------------------------------------------------------------

    def set_retention(self, tenant: str, session_id: str, retention: Retention) -> None:
        """The session's priority and TTL as its record now holds them (the API calls this
        after creating or patching the record; restart and other replicas' records are read
        here)."""
        key = self.key(tenant, session_id)
        with self._lock:
            self.retention.set(key, retention)
            self._tell_policy("set_priority", key, retention.priority)

    def _retain(self, record: SessionRecord) -> None:
        retention = Retention(record.priority, record.ttl_s)
        if retention != self.retention.get(record.key):
            self.set_retention(record.tenant, record.session_id, retention)

    def _drop_retention(self, key: SessionKey) -> None:
        """Under self._lock: the session is gone."""
        self.retention.drop(key)
        self.origins.drop(key)
        self._tell_policy("set_priority", key, 0)

    def kv_by_tier(self, tenant: str, session_id: str) -> dict[str, int]:
        """Stored tokens of the session per tier (each chunk counted at its fastest tier);
        empty when the store holds none."""
        chain = self.index.get(self.key(tenant, session_id))
        if chain is None:
            return {}
        C, n = self.settings.chunk_tokens, len(chain.token_ids)
        return tokens_by_tier(chain.chunks, C, 0, n, self.chunk_tier)

    def _prefetch_candidates(self) -> list[Hashable]:
        candidates = getattr(self.session_policy, "prefetch_candidates", None)
        if candidates is None or self.tiers.top is None:
            return []
        with self.tiers.lock:
            return candidates(self._session_tier, top=self.tiers.top.name)

    def _tell_policy(self, what: str, key: Hashable, *args: Any) -> None:
        """touch / forget / set_priority of a session (a custom chooser may lack the last).
        The session policy is also read by evictions, under the tiers' lock: every call into
        it takes that lock (after ours, never before)."""
        hook = getattr(self.session_policy, what, None)
        if hook is None:
            return
        with self.tiers.lock:
            hook(key, *args)

    def _prefetch_session(self, key: Hashable, touch: bool) -> int:
        chain = self.index.get(key)  # type: ignore[arg-type]
        if chain is None:
            return 0
        if touch:
            with self._lock:
                self._tell_policy("touch", key)
        return sum(self.tiers.prefetch(c) for c in chain.chunks if c not in self._pending)

    def _session_tier(self, key: Hashable) -> str | None:
        """The slowest tier any of the session's chunks is in (None: none stored)."""
        chain = self.index.get(key)  # type: ignore[arg-type]
        if chain is None:
            return None
        names = [t.name for t in self.tiers.tiers]
        worst = None
        for chunk in chain.chunks:
            where = self.tiers.where(chunk)
            if where is None:
                return worst
            if worst is None or names.index(where) > names.index(worst):
                worst = where
        return worst

    def _mean_session_bytes(self) -> float:
        n = len(self.index)
        return sum(t.used_bytes() for t in self.tiers.tiers) / n if n else 0.0

    # -- finding and reading ----------------------------------------------------------------

    def find(self, tenant: str, session_id: str) -> StoredSession | None:
        """The session's stored history: its leading tokens whose chunks are all available
        (stored in a tier or waiting in the write buffer). No KV is read. An expired session
        reads as absent (the purge timer deletes it: not here, on the engine thread)."""
        key = self.key(tenant, session_id)
        with self._lock:
            chain = self.index.get(key)
            if chain is None or self._expired(key, chain):
                self.tiers.counters.misses += 1
                return None
            self._tell_policy("touch", key)
        n = 0
        for chunk in chain.chunks:
            if not (self.has_chunk(chunk) or chunk in self._held):
                break
            n += 1
        tokens = chain.token_ids[: min(len(chain.token_ids), n * self.settings.chunk_tokens)]
        return StoredSession(key, tokens, chain.chunks[:n], self.settings.chunk_tokens)

    def read_chunks(
        self,
        keys: list[ChunkKey],
        count: bool = True,
        rows: list[tuple[int, int] | None] | None = None,
    ) -> list[SessionKV | None]:
        """The chunks' KV (None where one is gone), from the write buffer, the copies held
        for opened turns, or the fastest tier (moved up to DRAM). count: a load (hits and
        misses counted), not a re-read; rows: per chunk, only rows [start, end) (None: all)."""
        out: list[SessionKV | None] = []
        for i, key in enumerate(keys):
            span = rows[i] if rows is not None else None
            memo = self._pending.get(key)
            value = self._pending_value(memo, key) if memo is not None else self._held.get(key)
            if value is not None:
                if count:
                    self.tiers.count_pending_hit(key)
                if span is not None:
                    value = SessionKV(
                        value.token_ids[span[0] : span[1]], value.kv[:, :, span[0] : span[1]]
                    )
                out.append(value)
            else:
                out.append(self.tiers.get(key, count=count, rows=span))
        return out

    def _pending_value(self, memo: _Memo, key: ChunkKey) -> SessionKV | None:
        """A chunk still in the write buffer, whole (a delta joined to its base); None if
        its base is gone, which means the turn has just landed (read the tiers)."""
        value = memo()[key]
        if not isinstance(value, ChunkDelta):
            return value
        base = self.read_chunks([value.base], count=False)[0]
        if base is None:
            return None
        kv = torch.cat([base.kv[:, :, : value.keep], value.rows.kv.to(base.dtype)], dim=2)
        return SessionKV(base.token_ids[: value.keep] + value.rows.token_ids, kv)

    def has_chunk(self, key: ChunkKey) -> bool:
        return key in self._pending or self.tiers.contains(key)

    def lookup(self, tenant: str, session_id: str) -> SessionKV | None:
        """The session's whole stored KV in one tensor (tools and tests; the engine reads
        only the chunks it needs through `find` + `read_chunks`)."""
        stored = self.find(tenant, session_id)
        if stored is None or not stored.chunks:
            return None
        values = self.read_chunks(stored.chunks)
        if any(v is None for v in values):
            return None
        kv = torch.cat([v.kv for v in values if v is not None], dim=2)
        return SessionKV(list(stored.token_ids), kv)

    def tier_of(self, tenant: str, session_id: str) -> str | None:
        self.wait_saved(tenant, session_id)
        return self._session_tier(self.key(tenant, session_id))

    def saved_tokens(self, tenant: str, session_id: str) -> list[int]:
        self.wait_saved(tenant, session_id)
        record = self.records.get(self.key(tenant, session_id))
        return list(record.token_ids) if record else []

    # -- saving -------------------------------------------------------------------------------

    def plan_turn(
        self, tenant: str, token_ids: list[int], stored: StoredSession | None, reusable: int
    ) -> TurnPlan:
        """The chain of a history of token_ids whose first `reusable` tokens are the stored
        session's, and which of its chunks are new (not held by the store)."""
        return plan_chain(self.hasher, tenant, token_ids, stored, reusable, self.has_chunk)

    def save_turn(
        self,
        tenant: str,
        session_id: str,
        plan: TurnPlan,
        build: Callable[[], dict[ChunkKey, Any]],
        nbytes: int,
        opened_at: float | None = None,
    ) -> None:
        """Make plan's chain the session's history; `build()` gives the plan's new chunks,
        as SessionKV or, for a chunk with a base (plan.bases), as ChunkDelta (called once, on
        the writer thread with async_save, else here). Returns once a lookup sees the new
        chain. `opened_at` (time.monotonic() when the turn began): a turn older than the
        session's deletion is dropped, so an aborted turn cannot bring a deleted session
        back."""
        chain = SessionChain(list(plan.token_ids), list(plan.chain))
        self._write_turn(
            self.key(tenant, session_id),
            chain,
            plan,
            build,
            nbytes,
            self.settings.async_save,
            opened_at,
        )

    def _write_turn(
        self,
        key: SessionKey,
        chain: SessionChain,
        plan: TurnPlan | None,
        build: Callable[[], dict[ChunkKey, Any]],
        nbytes: int,
        background: bool,
        opened_at: float | None = None,
    ) -> None:
        """Index `chain` as key's history now (its new chunks readable from the write buffer)
        and commit the turn: on the writer thread when `background`, else here."""
        memo = _Memo(lambda: {k: self._in_storage_dtype(v) for k, v in build().items()})
        new = list(plan.new_chunks) if plan is not None else []
        bases = [base for base, _ in plan.bases.values()] if plan is not None else []
        with self._lock:
            deleted = self._deleted.get(key)
            drop = deleted is not None and opened_at is not None and opened_at <= deleted
            if not drop:
                for chunk in new:
                    self._pending[chunk] = memo
                for base in bases:  # kept until this turn's chunks are built on it
                    self._base_pins[base] = self._base_pins.get(base, 0) + 1
                freed = self.index.set(key, chain)
                self._tell_policy("touch", key)
        if drop:
            log.info("dropped the save of a turn begun before %s was deleted", key)
            build()  # it releases what the turn's rows hold (the layer saver's arena)
            return
        write = TurnWrite(key, chain, new, freed, memo, bases)
        if background:
            self.writer.submit(key, lambda: write, nbytes)
        else:
            self._commit(key, write)
        self._bump_version(key)

    def _in_storage_dtype(self, value: Any) -> Any:
        dtype = self.settings.storage_dtype
        if isinstance(value, ChunkDelta):
            return ChunkDelta(value.base, value.keep, value.rows.to(dtype))
        return value.to(dtype)

    def save(self, tenant: str, session_id: str, value: SessionKV) -> str | None:
        """Keep value as the session's whole KV (tools, tests, truncation): its chunks not
        stored yet are written; the tier its last chunk is in."""
        self.wait_saved(tenant, session_id)
        plan = self.plan_turn(tenant, list(value.token_ids), None, 0)

        def build() -> dict[ChunkKey, SessionKV]:
            out = {}
            for i, chunk in enumerate(plan.chain):
                if chunk in plan.new_chunks:
                    a, b = plan.span(i)
                    out[chunk] = SessionKV(value.token_ids[a:b], value.kv[:, :, a:b].clone())
            return out

        chain = SessionChain(list(plan.token_ids), list(plan.chain))
        self._write_turn(self.key(tenant, session_id), chain, plan, build, 0, background=False)
        return self.tiers.where(plan.chain[-1]) if plan.chain else None

    def _commit(self, key: Hashable, write: Any) -> None:
        """Writer thread: new chunks in, then the record, then the chunks nobody holds out. A
        crash between any two leaves the old or the new record with every chunk it lists
        (or, after a write_back crash, its leading chunks), plus orphans the next start
        deletes."""
        assert isinstance(write, TurnWrite)
        with self._mutate:
            try:
                values = write.values() if write.new_chunks else {}
                for chunk in write.new_chunks:
                    value = values.get(chunk)
                    if value is None or not self._needed(chunk):
                        continue
                    if isinstance(value, ChunkDelta):
                        # The base is the session's old tail: when nobody else holds it and no
                        # other pending turn builds on it, DRAM extends its blocks in place.
                        base = value.base
                        free = not self.index.referenced(base) and self._base_pins.get(base) == 1
                        landed, written = self.tiers.put_extension(
                            chunk, value.base, value.keep, value.rows, may_take_base=free
                        )
                    else:
                        landed, written = self.tiers.put(chunk, value), value.nbytes
                    if landed is not None:
                        self.bytes_written += written
                        self._persist_later(chunk)
            finally:
                with self._lock:
                    for chunk in write.new_chunks:
                        if self._pending.get(chunk) is write.memo:
                            del self._pending[chunk]
                    for base in write.bases:
                        left = self._base_pins.pop(base, 1) - 1
                        if left:
                            self._base_pins[base] = left
            current = self.index.get(write.key)
            if current is write.chain:  # the record after its chunks, before the frees
                self.records.upsert(
                    write.key,
                    token_ids=list(write.chain.token_ids),
                    chunks=[c.digest for c in write.chain.chunks],
                    fingerprint=self.fingerprint,
                )
            for chunk in write.freed:
                if not self._needed(chunk) and chunk not in self._pending:
                    self.tiers.delete(chunk)

    def _persist_later(self, chunk: ChunkKey) -> None:
        persister = self.persister
        if self.settings.persist != "write_through":
            if persister is not None:
                persister.add(chunk)
        elif persister is not None and persister.backing_off():
            persister.retry(chunk)  # the tier refused the last copies: no attempt until due
        elif not self._copy_down(chunk) and persister is not None:
            persister.retry(chunk)

    def _persist_chunk(self, chunk: ChunkKey) -> bool:
        """Write-back (the persister's thread): see _copy_down. False: try again later."""
        with self._mutate:
            return not self.index.referenced(chunk) or self._copy_down(chunk)

    def _copy_down(self, chunk: ChunkKey) -> bool:
        """The chunk's copy on SSD (warm restart) and, with Redis, in Redis too, where another
        replica finds it when a session moves there. False when the chunk is still only in
        DRAM because the first slow tier did not take it (its map or disk is full): it stays
        there, served from there, and the persister tries again with a backoff."""
        copied = self.tiers.persist(chunk)
        self.tiers.share(chunk)
        top = self.tiers.top
        return copied or top is None or self.tiers.where(chunk) != top.name

    def _needed(self, chunk: ChunkKey) -> bool:
        """Held by a session, or the base a pending turn builds a chunk on (a turn may be
        submitted before the previous one, which stores that base, has committed)."""
        return self.index.referenced(chunk) or chunk in self._base_pins

    def yield_to(self, idle: threading.Event) -> None:
        """idle is clear while the engine runs a prefill: background writes (the writer, the
        write-back) wait for it to be set, so that they do not lengthen a TTFT."""
        self.writer.idle = idle
        if self.persister is not None:
            self.persister.idle = idle

    def wait_saved(self, tenant: str, session_id: str, timeout: float = WAIT_SAVED_S) -> bool:
        """Until no write of the session is pending (its newest turn is fully stored)."""
        return self.writer.wait(self.key(tenant, session_id), timeout)

    def flush_writes(self, timeout: float | None = None) -> bool:
        return self.writer.flush(timeout)

    def flush_persist(self, timeout: float | None = None) -> bool:
        """Pending writes land, then every stored chunk due for write-back reaches LMDB."""
        ok = self.writer.flush(timeout)
        return (self.persister.flush(timeout) if self.persister is not None else True) and ok

    # -- removing ---------------------------------------------------------------------------

    def delete_session(self, tenant: str, session_id: str) -> bool:
        """Remove the session's record and the chunks no other session holds."""
        key = self.key(tenant, session_id)
        self.release_hold(self.take_hold(tenant, session_id))  # its opened turn's, if any
        self.writer.wait(key, WAIT_SAVED_S)
        # Under _mutate, so a turn the writer is committing cannot re-create the record
        # between its check and our delete; the tombstone drops turns begun before now.
        with self._mutate:
            with self._lock:
                self._tombstone(key)
                found = self.index.get(key) is not None
                freed = self.index.remove(key)
                self._tell_policy("forget", key)
                self._drop_retention(key)
            existed = bool(self.records.delete(key))
        self._free(freed)
        self._bump_version(key)
        return existed or found

    def shred_tenant(self, tenant: str) -> int:
        """Crypto-shred tenant: its key is destroyed first (every sealed copy of its data, in
        any tier or backup, stops opening at once), then its sessions are deleted, then any of
        its chunks still stored (orphans) are; how many sessions went. Its records the index
        does not know (no KV) are the caller's to delete (records.delete_tenant)."""
        if self.sealer is not None:
            self.sealer.keyring.shred(tenant)
        with self._lock:
            sessions = [k for k in self.index.sessions() if k.tenant == tenant]
        for key in sessions:
            self.delete_session(tenant, key.session_id)
        with self._mutate:
            held = [c for t in self.tiers.tiers for c in list(t.keys())]
            left = {c for c in held if c.tenant == tenant}
            for chunk in left:
                if not self._needed(chunk) and chunk not in self._pending:
                    self.tiers.delete(chunk)
        return len(sessions)

    def _tombstone(self, key: SessionKey) -> None:
        now = time.monotonic()
        self._deleted[key] = now
        if len(self._deleted) > TOMBSTONES_MAX:  # keep the newest; old turns are long over
            for old in sorted(self._deleted, key=self._deleted.__getitem__)[: TOMBSTONES_MAX // 2]:
                del self._deleted[old]

    def _free(self, chunks: list[ChunkKey]) -> None:
        with self._mutate:
            for chunk in chunks:
                if not self._needed(chunk) and chunk not in self._pending:
                    self.tiers.delete(chunk)

    def purge_expired(self) -> list[SessionKey]:
        self.writer.flush(WAIT_SAVED_S)
        gone = self.records.purge_expired()
        for key in gone:
            with self._lock:
                self._tombstone(key)
                freed = self.index.remove(key)
                self._tell_policy("forget", key)
                self._drop_retention(key)
            self._free(freed)
            self._bump_version(key)
        return gone

    def invalidate_all(self) -> int:
        """Drop every session's KV (records keep their messages); how many sessions had KV."""
        self.writer.flush(WAIT_SAVED_S)
        with self._lock:
            dropped = len(self.index)
            for key in self.index.sessions():
                self.index.remove(key)
                self._tell_policy("forget", key)
            self._epoch = next(self._version_clock)
            self._versions.clear()
        with self._mutate:
            self.tiers.clear()
        for record in self.records.list_sessions():
            self.records.upsert(record.key, token_ids=[], chunks=[])
        return dropped

    def _expired(self, key: SessionKey, chain: SessionChain) -> bool:
        ttl = self.retention.get(key).ttl(self.settings.session_ttl_s)
        return ttl > 0 and chain.updated_at + ttl < time.time()

    # -- versions ---------------------------------------------------------------------------

    def version(self, tenant: str, session_id: str) -> int:
        """A number that changes whenever the session's saved KV may have changed and stays
        the same while it only moves between tiers. Read it *before* looking the session up."""
        with self._lock:
            return max(self._versions.get(self.key(tenant, session_id), 0), self._epoch)

    def _bump_version(self, key: SessionKey) -> None:
        with self._lock:
            self._versions[key] = next(self._version_clock)

    # -- truncation ---------------------------------------------------------------------------

    def fit_context(
        self, tenant: str, session_id: str | None, prompt_ids: list[int], head: int, tail: int
    ) -> list[int]:
        """The prompt cut to `max_context_tokens`: whole chunks of the oldest history after the
        chunks holding the first `head` tokens are dropped (`tail` = new message + reply budget
        kept); the session's chain loses the same chunks, the kept ones stay valid and are
        re-positioned at load (K is stored before RoPE)."""
        s = self.settings
        plan = plan_truncation(
            len(prompt_ids), head, tail, s.max_context_tokens, s.truncation_ratio
        )
        if plan is None:
            return list(prompt_ids)
        C = s.chunk_tokens
        head_c = -(-head // C) * C
        drop_c = -(-plan.drop // C) * C
        aligned = head_c + drop_c <= len(prompt_ids) - tail
        if aligned:
            plan = TruncationPlan(head_c, drop_c)
        if session_id is not None:
            self._truncate_session(self.key(tenant, session_id), prompt_ids, plan, aligned)
        return plan.apply_ids(prompt_ids)

    def _truncate_session(
        self, key: SessionKey, prompt_ids: list[int], plan: TruncationPlan, aligned: bool
    ) -> None:
        self.writer.wait(key, WAIT_SAVED_S)
        stored = self.find(key.tenant, key.session_id)
        if stored is None:
            return
        lcp = common_prefix_len(stored.token_ids, prompt_ids)
        if not aligned:  # chunks cannot stay whole: the kept KV is written again, cut
            value = self.lookup(key.tenant, key.session_id)
            if value is not None:
                self.save(key.tenant, key.session_id, plan.apply_kv(value.prefix(lcp)))
            return
        C = self.settings.chunk_tokens
        full = {i for i in range(len(stored.chunks)) if stored.span(i)[1] <= lcp}
        first_dropped = plan.head // C
        keep = []
        while len(keep) < first_dropped and len(keep) in full:
            keep.append(len(keep))
        if len(keep) == first_dropped:  # the head is whole: what follows the cut
            i = (plan.head + plan.drop) // C
            while i in full:
                keep.append(i)
                i += 1
        ids: list[int] = []
        for i in keep:
            a, b = stored.span(i)
            ids.extend(stored.token_ids[a:b])
        chain = SessionChain(ids, [stored.chunks[i] for i in keep])
        self._write_turn(key, chain, None, dict, 0, self.settings.async_save)

    # -- stats and lifecycle --------------------------------------------------------------------

    def stats(self) -> StoreStats:
        from dataclasses import replace

        with self.tiers.lock:
            c = self.tiers.counters
            counters = replace(c, tiers={n: t.copy() for n, t in c.tiers.items()})
        health = self.redis_breaker.health() if self.redis_breaker is not None else None
        first = self.tiers.tiers[0].name
        return StoreStats(self.tiers.stats_occupancy(), counters, first, health)

    def add_listener(self, listener: Listener) -> None:
        self.events.add_listener(listener)

    def close(self, flush_dram: bool = True) -> None:
        """Graceful shutdown: pending writes land, DRAM chunks are written to LMDB (so a
        restart finds them), then the tiers close."""
        self.prefetcher.close()
        self.writer.close()
        if self.persister is not None:
            self.persister.close(flush=flush_dram)
        if flush_dram:
            with self._mutate:
                self.tiers.demote_all()
        else:
            self.tiers.drain_background()  # write-downs in flight land before the tiers close
        if self.shared_shreds is not None:
            self.shared_shreds.close()
        for tier in self.tiers.tiers:
            tier.close()
        self.records.close()


class _Memo:
    """build() run once, whichever thread asks first (the writer or a reader)."""

    def __init__(self, build: Callable[[], dict[ChunkKey, Any]]) -> None:
        self._build = build
        self._value: dict[ChunkKey, Any] | None = None
        self._lock = threading.Lock()

    def __call__(self) -> dict[ChunkKey, Any]:
        with self._lock:
            if self._value is None:
                self._value = self._build()
            return self._value


def create_store(
    config: Config, spec: ModelSpec, fingerprint: str, **kwargs: Any
) -> AttentionStore | None:
    """The store for this config, or None when `kv_store = "off"` (the recompute baseline)."""
    if config.kv_store == "off":
        return None
    return AttentionStore(StoreSettings.from_config(config), spec, fingerprint, **kwargs)
