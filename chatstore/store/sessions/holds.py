"""What an opened turn holds of its session's KV until the engine has read it.

The engine's thread reads host memory only (no SSD, no Redis), so the API thread that opens a
turn (`AttentionStore.fetch_remote`) brings the chunks only LMDB or Redis holds up first.
Between that and the engine's admission read, nothing may push them back down: with a DRAM tier
smaller than the session, or shared with other turns opened meanwhile, each promotion would
otherwise evict the chunks promoted just before it (KV moved up for nothing, then recomputed).

    open (API thread)        pin every chunk of the chain: no DRAM eviction picks a pinned one
                             LMDB/Redis-only chunk -> promoted into DRAM; where DRAM cannot
                             take it (none, too small, full of pinned chunks) -> kept beside
                             it (held)
    admission (engine)       the connector takes the hold, reads the chunks (DRAM or held)
    read done / turn ended   released: pins dropped, held copies freed
    never admitted           released by the next opening after HOLD_TTL_S

Held copies are host memory outside the tiers, bounded by the store (`write_buffer_bytes`,
the bound on the other KV it keeps outside them); past it, the rest of the chain is recomputed.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from chatstore.store.chunks import ChunkKey
from chatstore.store.session_kv import SessionKey

HOLD_TTL_S = 60.0  # an opened turn not admitted by then lets go of its chunks


@dataclass
class TurnHold:
    """The chunks one opened turn pins (each once), in chain order."""

    key: SessionKey
    chunks: list[ChunkKey] = field(default_factory=list)
    opened_at: float = field(default_factory=time.monotonic)

    def expired(self, now: float) -> bool:
        return now - self.opened_at > HOLD_TTL_S


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


class TurnHolds:
    """session -> the hold of its opened turn, until the connector takes it at admission."""

    def __init__(self) -> None:
        self._holds: dict[SessionKey, TurnHold] = {}
        self._lock = threading.Lock()

    def put(self, hold: TurnHold) -> list[TurnHold]:
        """Keep hold for its session; the holds to release (the session's previous one, which
        was never taken, and every lapsed one)."""
        with self._lock:
            old = self._holds.pop(hold.key, None)
            out = self._lapsed()
            self._holds[hold.key] = hold
        return [old, *out] if old is not None else out

    def take(self, key: SessionKey) -> tuple[TurnHold | None, list[TurnHold]]:
        """The session's hold (now the taker's to release), and the lapsed ones to release."""
        with self._lock:
            return self._holds.pop(key, None), self._lapsed()

    def _lapsed(self) -> list[TurnHold]:
        now = time.monotonic()
        gone = [k for k, h in self._holds.items() if h.expired(now)]
        return [self._holds.pop(k) for k in gone]
