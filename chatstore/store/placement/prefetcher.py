"""Scheduler-aware fetch (CachedAttention §3.3.1): an I/O thread that moves sessions up to DRAM
before the engine schedules them.

    every `interval_s`, or at once when poked (a hint or `poke()`):
        keys  = hints (clients typing, POST /v1/sessions/{id}/prefetch), oldest first
              + candidates(): sessions in the look-ahead window over the engine's waiting queue
                (L_pw = C_mem / S_kv) that sit below DRAM   (policy "aware"; none for lru/fifo)
        for key in keys: prefetch(key, hinted)   the session's chunks LMDB/Redis -> DRAM

Chunks are immutable, so a prefetch racing with the engine's read of the same chunk is harmless:
the read finds it in DRAM or below, a promotion leaves the copy below in place.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable

from chatstore.cpu_threads import own_intra_op_threads

log = logging.getLogger(__name__)

MAX_HINTS = 1024  # hints beyond this are dropped (oldest first): they are only hints


class Prefetcher:
    def __init__(
        self,
        prefetch: Callable[[Hashable, bool], int],
        candidates: Callable[[], list[Hashable]] = list,
        interval_s: float = 0.05,
    ) -> None:
        self._prefetch = prefetch
        self._candidates = candidates
        self.interval_s = interval_s
        self._hints: dict[Hashable, None] = {}  # insertion-ordered set
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.moved = 0
        self.rounds = 0

    def start(self) -> None:
        with self._lock:
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(
                    target=self._loop, name="chatstore-prefetch", daemon=True
                )
                self._thread.start()

    def hint(self, key: Hashable) -> None:
        """Ask for `key` to be moved up soon (returns at once)."""
        with self._lock:
            self._hints.pop(key, None)
            self._hints[key] = None
            while len(self._hints) > MAX_HINTS:
                self._hints.pop(next(iter(self._hints)))
        self.start()
        self._wake.set()

    def poke(self) -> None:
        self.start()
        self._wake.set()

    def run_once(self) -> int:
        """One round: hints first, then the queue's window; the number of sessions moved up."""
        with self._lock:
            hints = list(self._hints)
            self._hints.clear()
        keys = dict.fromkeys(hints)
        try:
            keys.update(dict.fromkeys(self._candidates()))
        except Exception:
            log.exception("prefetch: reading the waiting queue failed")
        moved = 0
        for key in keys:
            if self._stop.is_set():
                break
            try:
                moved += self._prefetch(key, key in hints)
            except Exception:
                log.exception("prefetch of %s failed", key)
        self.moved += moved
        self.rounds += 1
        return moved

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join()

    def _loop(self) -> None:
        # Tier moves copy big tensors: on one intra-op thread, so that no second OpenMP pool
        # throttles the engine's (see chatstore/engine/cpu_threads.py).
        own_intra_op_threads(1)
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if not self._stop.is_set():
                self.run_once()
