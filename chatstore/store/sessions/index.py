"""Which chunks each session holds, and which sessions hold each chunk (reference counts).

    sessions:  session key -> SessionChain(token ids, chunk keys, updated_at)
    owners:    chunk key   -> {session keys whose chain lists it}

A chunk is freed when the last session holding it lets go (its chain replaced by a turn or a
truncation, deleted, expired). Kept in memory, rebuilt from the session records at start; the
store guards writes with its lock, and the read-only questions the tiers ask (`referenced`,
`holds`, `owner_count`) are single dict or set reads, safe from any thread. A chunk's owner set
is changed in place (a shared system prompt's chunk is held by every session: copying its set
on each turn made a turn cost O(sessions)); `owners_of` hands out a copy, made in one step under
the GIL, for the few callers that want the whole set (never eviction: placement/chunk_ranks.py
follows the changes instead, told by `watch`). A new chain is applied as a difference from the
old one, so a turn that keeps its prefix does not touch the prefix's owner sets.
"""

from __future__ import annotations

import array
import builtins
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from chatstore.store.chunks.keys import ChunkHasher
from chatstore.store.records.record import SessionRecord
from chatstore.store.session_kv import ChunkKey, SessionKey

_NOBODY: frozenset[SessionKey] = frozenset()

# Told (session, taken, let go) after each change of a session's chain: the chunks it came to
# hold (or holds at a new position) and those it let go. Called under the store's lock on the
# writing thread: a listener must not block (the placement queues what it is told).
OwnerListener = Callable[[SessionKey, list[ChunkKey], list[ChunkKey]], None]


@dataclass(frozen=True)
class SessionChain:
    token_ids: Sequence[int]  # a list, or a 32-bit array for chains read from records
    chunks: list[ChunkKey]
    updated_at: float = field(default_factory=time.time)

    @classmethod
    def of_record(
        cls, record: SessionRecord, hasher: ChunkHasher, fingerprint: str
    ) -> SessionChain | None:
        """The chain a session record lists, when its KV is reusable here: it lists chunks,
        made by this model (`fingerprint`: another model's ids are not ours) with this chunk
        size; else None. Token ids as a 32-bit array (4 bytes a token, not a Python int's ~36:
        what a server holds for each idle session)."""
        chunks = record.chunks
        if not chunks or not record.token_ids or record.fingerprint != fingerprint:
            return None
        if hasher.num_chunks(len(record.token_ids)) != len(chunks):
            return None  # a record from another chunk size
        keys = [ChunkKey(record.tenant, d) for d in chunks]
        return cls(array.array("i", record.token_ids), keys, record.updated_at)


class SessionIndex:
    def __init__(self) -> None:
        self._sessions: dict[SessionKey, SessionChain] = {}
        self._owners: dict[ChunkKey, builtins.set[SessionKey]] = {}
        self._positions: dict[ChunkKey, int] = {}
        self._listeners: list[OwnerListener] = []

    def watch(self, listener: OwnerListener) -> None:
        """listener is told every change of a chunk's owners from now on."""
        self._listeners.append(listener)

    def _tell(self, key: SessionKey, taken: list[ChunkKey], let_go: list[ChunkKey]) -> None:
        if taken or let_go:
            for listener in self._listeners:
                listener(key, taken, let_go)

    def get(self, key: SessionKey) -> SessionChain | None:
        return self._sessions.get(key)

    def set(self, key: SessionKey, chain: SessionChain) -> list[ChunkKey]:
        """key now holds chain; the chunks that lost their last holder. Only the chunks that
        differ between the old chain and the new one change owners."""
        old = self._sessions.get(key)
        self._sessions[key] = chain
        before = dict.fromkeys(old.chunks) if old is not None else {}
        taken: list[ChunkKey] = []
        for i, chunk in enumerate(chain.chunks):
            holders = self._owners.get(chunk)
            if chunk in before and holders is not None and key in holders:
                if len(holders) == 1 and self._positions.get(chunk) != i:
                    # Its only holder moved it (a truncation): the position follows, as when
                    # the chunk was let go and taken again.
                    self._positions[chunk] = i
                    taken.append(chunk)
                continue
            if holders is None:
                self._owners[chunk] = {key}
            elif key in holders:
                continue  # listed twice in the new chain
            else:
                holders.add(key)
            self._positions.setdefault(chunk, i)
            taken.append(chunk)
        kept = dict.fromkeys(chain.chunks)
        return self._let_go(key, [c for c in before if c not in kept], taken)

    def remove(self, key: SessionKey) -> list[ChunkKey]:
        """Forget key; the chunks that lost their last holder."""
        chain = self._sessions.pop(key, None)
        if chain is None:
            return []
        return self._let_go(key, list(dict.fromkeys(chain.chunks)), [])

    def _let_go(
        self, key: SessionKey, chunks: list[ChunkKey], taken: list[ChunkKey]
    ) -> list[ChunkKey]:
        """key lets go of chunks; the listeners hear of it and of what it took (`taken`)."""
        freed, let_go = [], []
        for chunk in chunks:
            holders = self._owners.get(chunk)
            if holders is None or key not in holders:
                continue
            holders.discard(key)
            if not holders:
                del self._owners[chunk]
                self._positions.pop(chunk, None)
                freed.append(chunk)
            let_go.append(chunk)
        self._tell(key, taken, let_go)
        return freed

    def referenced(self, chunk: ChunkKey) -> bool:
        return chunk in self._owners

    def holds(self, chunk: ChunkKey, key: SessionKey) -> bool:
        holders = self._owners.get(chunk)
        return holders is not None and key in holders

    def owner_count(self, chunk: ChunkKey) -> int:
        """How many sessions hold chunk: the owner set's own size (kept as it changes)."""
        return len(self._owners.get(chunk, ()))

    def owners_of(self, chunk: ChunkKey) -> frozenset[SessionKey]:
        holders = self._owners.get(chunk)
        return _NOBODY if holders is None else frozenset(holders)

    def position_of(self, chunk: ChunkKey) -> int:
        return self._positions.get(chunk, 0)

    def sessions(self) -> list[SessionKey]:
        return list(self._sessions)

    def chunks(self) -> builtins.set[ChunkKey]:
        return set(self._owners)

    def __len__(self) -> int:
        return len(self._sessions)

    def describe(
        self, chunk: ChunkKey, chunk_tokens: int
    ) -> tuple[list[int], ChunkKey | None] | None:
        """(token ids, parent chunk) of a full chunk some session holds; else None. Reads
        without a lock: single dict reads of immutable chains."""
        C, pos = chunk_tokens, self.position_of(chunk)
        for owner in self.owners_of(chunk):
            chain = self.get(owner)
            if chain is None or pos >= len(chain.chunks) or chain.chunks[pos] != chunk:
                continue
            if (pos + 1) * C > len(chain.token_ids):
                return None
            ids = list(chain.token_ids[pos * C : (pos + 1) * C])
            return ids, chain.chunks[pos - 1] if pos else None
        return None
