"""Opening a turn (`OpenedTurn`, opened_turn.py): the session's chunks made readable by the
engine's thread, which reads host memory only (no SSD, no Redis), and kept so until it has read
them; where each chunk was, noted on the handle. With records in Redis, a chain another replica
saved after us is adopted first, whether or not this replica has a DRAM or SSD tier of its own.

A session with no stored chain here (new, or begun on a replica that shares no records with us)
borrows the stored chunks its prompt begins with: chunk keys are content-addressed (tenant,
model, every token before), so the leading full chunks of the prompt hash to the keys of any
session of the tenant that stored the same tokens (a shared system prompt), on this replica or,
through Redis, on another. They are pinned like a chain's and ride on the handle
(`OpenedTurn.borrowed`), which the engine's read serves as the session's stored history; the
turn's commit then references them as its own (plan.py keeps stored chunks by key).

    chunk in DRAM / write buffer / held      pinned, nothing to read
    chunk only SSD or Redis holds            read here (this API thread), promoted into DRAM,
                                             or kept beside it (held) when there is no DRAM
                                             tier or it cannot take it; bounded by
                                             write_buffer_bytes, past it the rest is recomputed

Between the opening and the engine's read nothing may push the pinned chunks back down: with a
DRAM tier smaller than the session, or shared with other turns opened meanwhile, each promotion
would otherwise evict the chunks promoted just before it (KV moved up for nothing, then
recomputed). The connector unpins them once read (`load_history`), the API at the turn's end
whatever happened (`end_turn`), a collected handle by itself.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Sequence

from chatstore.store.chunks.keys import ChunkHasher
from chatstore.store.commit.turn_commit import TurnCommitter
from chatstore.store.opened_turn import BorrowedPrefix, OpenedTurn, TurnChain
from chatstore.store.placement.session_placement import SessionPlacement
from chatstore.store.records.base import RecordStore
from chatstore.store.records.record import SessionRecord
from chatstore.store.session_kv import ChunkKey, SessionKey, SessionKV
from chatstore.store.sessions.holds import ChunkPins
from chatstore.store.sessions.index import SessionChain
from chatstore.store.sessions.versions import SessionVersions
from chatstore.store.tiers.chunk_tiers import ChunkTiers

log = logging.getLogger(__name__)


class TurnOpening:
    """Opens turns: pins, held copies, origins and borrowed prefixes, all on the handle.
    Thread-safe: the API's worker threads open turns, the engine thread reads and unpins them."""

    def __init__(
        self,
        committer: TurnCommitter,
        placement: SessionPlacement,
        records: RecordStore,
        hasher: ChunkHasher,
        versions: SessionVersions,
        retain: Callable[[SessionRecord], None],
        pins: ChunkPins,
        ensure: Callable[[SessionKey], None] = lambda key: None,
    ) -> None:
        """ensure(key): the session's chain read from its record while the index is still
        being restored (restore.py IndexRestore.ensure)."""
        self.committer, self.placement, self.records = committer, placement, records
        self.tiers: ChunkTiers = committer.tiers
        self.index, self.lock = committer.index, committer.lock
        self.hasher, self.versions, self._retain = hasher, versions, retain
        self.pins = pins  # chunks opened turns hold: never a DRAM victim (holds.py)
        self.held: dict[ChunkKey, SessionKV] = {}  # pinned chunks DRAM could not take
        self.held_bytes = 0
        self.remote = next((t for t in self.tiers.tiers if t.name == "remote"), None)
        self._unpin_lock = threading.Lock()
        self.ensure = ensure

    def open(
        self, key: SessionKey, prompt_ids: Sequence[int] = (), records_turn: bool = False
    ) -> OpenedTurn:
        """In chain order, stopping at the first chunk that is gone or cannot be held (the
        rest is recomputed): every chunk is pinned (no DRAM eviction picks it), and one only
        SSD or Redis holds is promoted to DRAM, or kept beside it when DRAM cannot take it
        (or there is none). A session without a chain borrows its prompt's stored prefix (see
        the module's doc). records_turn: the caller records the turn's chain (the handle's
        TurnChain), the commit does not."""
        self.ensure(key)
        if self.remote is not None:
            self._adopt(key)
        chain = self.index.get(key)
        borrowed = None
        if chain is None and prompt_ids:
            chain = self._borrow(key, prompt_ids)
            if chain is not None:
                borrowed = BorrowedPrefix(list(chain.token_ids), list(chain.chunks))
        chunks = chain.chunks if chain is not None else []
        # This turn's cached tokens count where it found them, whatever moves them up now.
        origins = {c: w for c in chunks if (w := self.chunk_tier(c))}
        opened = OpenedTurn(
            key,
            origins,
            borrowed,
            [],
            TurnChain(self.committer.writer.priority.urgent) if records_turn else None,
            _unpin=self.unpin,
        )
        if not self.tiers.slow:
            return opened  # every chunk is in DRAM (or gone): the engine reads it there
        moved = 0
        try:
            for chunk in chunks:
                self.pins.add(chunk)  # first: from now on no eviction takes it from DRAM
                opened.pinned.append(chunk)
                came_up = self._hold_chunk(chunk)
                if came_up is None:
                    self.unpin([opened.pinned.pop()])
                    break
                moved += came_up
        except BaseException:
            self.unpin(opened.pinned)
            raise
        opened.from_remote = moved
        if opened.pinned:  # a handle dropped without its end still lets them go
            opened.unpin_when_collected()
        return opened

    def _hold_chunk(self, chunk: ChunkKey) -> int | None:
        """Make a pinned chunk readable from host memory: 1 when it came up from the remote
        tier, 0 when from SSD or readable already, None when it is gone or cannot be held."""
        top = self.tiers.top
        if chunk in self.committer.pending or chunk in self.held:
            return 0  # the write buffer's (pinned: it stays in DRAM once it lands), or held
        if top is not None:
            with self.tiers.lock:
                if top.contains(chunk):
                    return 0  # pinned there now
        where = self.tiers.where(chunk)
        if where is None:
            return None
        # Only SSD or Redis holds it, or it is on its way down from DRAM: read here (the
        # engine's read counts the hit), into DRAM if it makes room without evicting a pinned
        # chunk, else kept beside it.
        value = self.tiers.get(chunk, promote=True, count=False)
        if value is None:
            return None
        in_dram = False
        if top is not None:
            with self.tiers.lock:
                in_dram = top.contains(chunk)
        if not in_dram:
            with self.lock:
                if self.held_bytes + value.nbytes > self.committer.settings.write_buffer_bytes:
                    return None
                if chunk not in self.held:
                    self.held[chunk] = value
                    self.held_bytes += value.nbytes
            if where == "remote":
                with self.tiers.lock:
                    self.tiers.counters.bytes_up += value.nbytes
        return 1 if where == "remote" else 0

    def _borrow(self, key: SessionKey, prompt_ids: Sequence[int]) -> SessionChain | None:
        """The stored chunks the prompt's leading full chunks hash to, up to the first one no
        tier holds (Redis asked once, pipelined, for those our tier does not know yet)."""
        C = self.hasher.chunk_tokens
        full = len(prompt_ids) // C
        if full == 0:
            return None
        ids = list(prompt_ids[: full * C])
        keys = self.hasher.chain(key.tenant, ids)
        if self.remote is not None:
            try:
                self.remote.discover(keys)  # type: ignore[attr-defined]
            except Exception as exc:  # TierUnavailable: what the local tiers hold
                log.debug("could not look up %s's prompt chunks: %s", key, exc)
        n = 0
        while n < len(keys) and self.chunk_tier(keys[n]) is not None:
            n += 1
        if n == 0:
            return None
        return SessionChain(ids[: n * C], keys[:n])

    def unpin(self, chunks: list[ChunkKey]) -> None:
        """Unpin an opened turn's chunks (its `pinned` list, emptied: released once, whoever
        asks again); a held copy goes with its last pin."""
        with self._unpin_lock:
            taken = list(chunks)
            chunks.clear()
        for chunk in taken:
            if self.pins.remove(chunk):
                with self.lock:
                    value = self.held.pop(chunk, None)
                    if value is not None:
                        self.held_bytes -= value.nbytes

    def prefetch_session(self, key: Hashable, touch: bool) -> int:
        """The prefetch thread's move of a session's stored chunks up to DRAM; how many."""
        chain = self.index.get(key)  # type: ignore[arg-type]
        if chain is None:
            return 0
        if touch:
            with self.lock:
                self.placement.tell("touch", key)
        pending = self.committer.pending
        return sum(self.tiers.prefetch(c) for c in chain.chunks if c not in pending)

    def chunk_tier(self, chunk: ChunkKey) -> str | None:
        """The fastest tier holding chunk; a chunk still in the write buffer, or held for an
        opened turn beside DRAM, is in host memory ("dram"); None when it is gone."""
        if chunk in self.committer.pending or chunk in self.held:
            return "dram"
        return self.tiers.where(chunk)

    def _adopt(self, key: SessionKey) -> None:
        """Take the session's chain from its shared record when another replica saved it
        after us (records and chunks in Redis): the chunks it lists that Redis holds become
        this session's history here. Skipped while a turn of ours is still being written."""
        if self.committer.writer.is_pending(key):
            return
        try:
            record = self.records.get(key)
        except Exception as exc:  # RecordStoreUnavailable: keep what we know
            log.debug("could not read %s's record: %s", key, exc)
            return
        if record is None:
            return
        self._retain(record)  # another replica may have changed it
        chain = SessionChain.of_record(record, self.hasher, self.committer.fingerprint)
        if chain is None:
            return
        try:  # those our Redis tier does not know yet (stored by another replica), one round
            self.remote.discover(chain.chunks)  # type: ignore[union-attr]
        except Exception as exc:  # TierUnavailable
            log.debug("could not look up %s's chunks: %s", key, exc)
            return
        current = self.index.get(key)
        if current is not None and current.chunks == chain.chunks:
            return  # the chain we know (read from the record at start, or our own)
        with self.lock:
            freed = self.index.set(key, chain)
            self.placement.tell("touch", key)
        self.committer.free(freed)
        self.versions.bump(key)
