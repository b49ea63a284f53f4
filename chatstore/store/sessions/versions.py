"""Session versions and tombstones.

`version(key)` changes whenever the session's saved KV may have changed and not when it only
moves between tiers (the read buffer compares it to know if a copy is stale). A tombstone
remembers when a session was deleted, so a turn opened before that cannot bring it back.
"""

from __future__ import annotations

import itertools
import threading
import time

from chatstore.store.session_kv import SessionKey

TOMBSTONES_MAX = 100_000  # deleted sessions remembered, so late saves of old turns are dropped


class SessionVersions:
    """Thread-safe (its own lock, taken last: it calls nothing back)."""

    def __init__(self) -> None:
        self._clock = itertools.count(1)
        self._versions: dict[SessionKey, int] = {}
        self._epoch = 0
        self._deleted: dict[SessionKey, float] = {}  # session -> monotonic time of deletion
        self._lock = threading.Lock()

    def get(self, key: SessionKey) -> int:
        with self._lock:
            return max(self._versions.get(key, 0), self._epoch)

    def bump(self, key: SessionKey) -> None:
        with self._lock:
            self._versions[key] = next(self._clock)

    def bump_all(self) -> None:
        """Every session's KV changed (all of it was dropped)."""
        with self._lock:
            self._epoch = next(self._clock)
            self._versions.clear()

    def tombstone(self, key: SessionKey) -> None:
        with self._lock:
            self._deleted[key] = time.monotonic()
            if len(self._deleted) > TOMBSTONES_MAX:  # keep the newest; old turns are long over
                by_age = sorted(self._deleted, key=self._deleted.__getitem__)
                for old in by_age[: TOMBSTONES_MAX // 2]:
                    del self._deleted[old]

    def deleted_since(self, key: SessionKey, opened_at: float | None) -> bool:
        """The session was deleted after a turn opened at `opened_at` (monotonic) began."""
        with self._lock:
            deleted = self._deleted.get(key)
        return deleted is not None and opened_at is not None and opened_at <= deleted
