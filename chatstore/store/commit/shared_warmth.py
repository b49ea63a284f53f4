"""Keeping the chunks turns reuse warm in the shared tier (Redis, `allkeys-lru`).

A replica serves a shared system prompt from its own DRAM (or device prefix cache), so Redis
sees no read of it and its LRU would evict it before the sessions' own, colder, chunks. So:

    each commit          its reused chunks get one pipelined EXPIRE (TTL and LRU clock move);
                         a chunk other sessions hold too that Redis does not have yet (its
                         write-back deferred by a burst of turns) is copied there now
    each write-back      the shared chunks reused in the last HOT_S are touched just before
    copy                 it lands: when that write makes Redis evict, the chunks written
                         before it are older than them, whatever order the batch had
"""

from __future__ import annotations

import threading
import time

from chatstore.store.session_kv import ChunkKey
from chatstore.store.sessions.index import SessionIndex
from chatstore.store.tiers.chunk_tiers import ChunkTiers

HOT_MAX = 256  # shared chunks remembered for the write-back's touch
HOT_S = 300.0  # ... that a turn reused within this long


class SharedWarmth:
    def __init__(self, tiers: ChunkTiers, index: SessionIndex, copy_shared: bool) -> None:
        """copy_shared: write-back is on (shared chunks may be copied to Redis early)."""
        self.tiers, self.index, self.copy_shared = tiers, index, copy_shared
        self._hot: dict[ChunkKey, float] = {}  # most recently reused last
        self._lock = threading.Lock()

    def reused(self, chunks: list[ChunkKey]) -> None:
        """A commit's chunks that were stored before it (the writer thread, off `mutate`)."""
        if not chunks or not any(t.remote for t in self.tiers.slow):
            return
        shared = {c for c in chunks if self.index.owner_count(c) > 1} if self.copy_shared else set()
        self.tiers.refresh_shared(chunks, copy_unknown=shared)
        now = time.monotonic()
        with self._lock:
            for chunk in shared:
                self._hot.pop(chunk, None)
                self._hot[chunk] = now
            while len(self._hot) > HOT_MAX:
                del self._hot[next(iter(self._hot))]

    def before_write_back(self) -> None:
        """The persister's hook, before each chunk it copies lands in Redis (one pipelined
        EXPIRE round, nothing when no shared chunk was reused lately)."""
        cutoff = time.monotonic() - HOT_S
        with self._lock:
            hot = [c for c, at in self._hot.items() if at >= cutoff]
        if hot:
            self.tiers.refresh_shared(hot)
