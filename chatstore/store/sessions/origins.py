"""Where a turn's history KV came from: each chunk's tier when the turn was opened.

The API opens a turn (`AttentionStore.fetch_remote`) before the engine queues it: at that
moment the store notes which tier holds each of the session's chunks, then brings what only
Redis holds up to DRAM. The store hands the note over at admission (`StoredSession.origins`)
and the connector counts the tokens it loads by it (`tokens_by_origin`), so a chunk that the
turn-opening fetch (or the prefetch thread, while the turn waited) moved up still counts where
the turn found it: `remote`, `ssd`.

    chunks     | c0 (ssd)       | c1 (dram)      | c2 (dram) |
    tokens     0        start   C               2C    end
    loaded              [ssd: C-start][dram: C  ][dram: end-2C]
"""

from __future__ import annotations

from chatstore.store.chunks import ChunkKey
from chatstore.store.session_kv import SessionKey

NOTES_MAX = 10_000  # sessions whose turn opened and has not been admitted yet


class TurnOrigins:
    """session -> {chunk: tier name} as of its turn's opening; taken once, at admission."""

    def __init__(self, limit: int = NOTES_MAX) -> None:
        self._notes: dict[SessionKey, dict[ChunkKey, str]] = {}
        self._limit = limit

    def note(self, key: SessionKey, where: dict[ChunkKey, str]) -> None:
        self._notes.pop(key, None)
        self._notes[key] = where
        if len(self._notes) > self._limit:  # turns that never reached the engine
            del self._notes[next(iter(self._notes))]

    def take(self, key: SessionKey) -> dict[ChunkKey, str]:
        return self._notes.pop(key, {})

    def drop(self, key: SessionKey) -> None:
        self._notes.pop(key, None)
