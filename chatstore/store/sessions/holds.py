"""Which chunks opened turns pin: never a DRAM victim while the engine has not read them.

The engine's thread reads host memory only (no SSD, no Redis), so the API thread that opens a
turn (turn_opening.py) brings the chunks only LMDB or Redis holds up first and pins every chunk
of the turn's chain here, one count per opened turn; the turn's handle (`OpenedTurn.pinned`)
lets them go once read. Eviction asks `chunk in pins` under the tiers' lock.
"""

from __future__ import annotations

import threading

from chatstore.store.session_kv import ChunkKey


class ChunkPins:
    """chunk -> how many opened turns pin it. Thread-safe; `__contains__` is what eviction asks
    (under the tiers' lock: it takes only this object's own lock, never another)."""

    def __init__(self) -> None:
        self._counts: dict[ChunkKey, int] = {}
        self._lock = threading.Lock()

    def add(self, chunk: ChunkKey) -> None:
        with self._lock:
            self._counts[chunk] = self._counts.get(chunk, 0) + 1

    def remove(self, chunk: ChunkKey) -> bool:
        """One pin less; True when none is left."""
        with self._lock:
            left = self._counts.get(chunk, 0) - 1
            if left > 0:
                self._counts[chunk] = left
                return False
            self._counts.pop(chunk, None)
            return True

    def __contains__(self, chunk: object) -> bool:
        return chunk in self._counts

    def __len__(self) -> int:
        return len(self._counts)
