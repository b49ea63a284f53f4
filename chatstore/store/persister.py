"""Write-back of completed chunks to the SSD tier (`persist = "write_back"`), so that a server
killed with -9 restarts warm.

A chunk stored in DRAM is copied to LMDB at most `lag_s` seconds later, off the engine thread,
in batches: a turn's chunks usually arrive together and are written together. The copy is left
in DRAM (chunks are immutable: both copies are valid). The session record already lists the
chunk; until its copy lands a crash loses only that chunk, and the session reloads up to it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from chatstore.engine.cpu_threads import lower_thread_priority, own_intra_op_threads
from chatstore.store.chunks import ChunkKey

log = logging.getLogger(__name__)


class Persister:
    def __init__(self, persist: Callable[[ChunkKey], None], lag_s: float) -> None:
        self._persist = persist
        self.lag_s = lag_s
        self._due: deque[tuple[float, ChunkKey]] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._busy = False
        self.persisted = 0
        self.idle: threading.Event | None = None
        self.max_defer_s = 0.5

    def add(self, key: ChunkKey) -> None:
        with self._cond:
            if self._closed:
                return
            self._due.append((time.monotonic() + self.lag_s, key))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="chatstore-persist", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Persist everything queued now (not waiting for its lag); False on timeout."""
        with self._cond:
            self._due = deque((0.0, key) for _, key in self._due)
            self._cond.notify_all()
            return self._cond.wait_for(lambda: not self._due and not self._busy, timeout)

    def pending(self) -> int:
        with self._cond:
            return len(self._due) + self._busy

    def close(self, flush: bool = True) -> None:
        if flush:
            self.flush(60.0)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(5.0)

    def _wait_turn(self) -> None:
        """Let a running prefill finish first (at most max_defer_s): see WriteBuffer."""
        idle = self.idle
        if idle is not None and not self._closed:
            idle.wait(self.max_defer_s)

    def _run(self) -> None:
        own_intra_op_threads(1)
        lower_thread_priority(19)  # background work with a lag budget
        while True:
            with self._cond:
                while not self._closed:
                    if self._due and self._due[0][0] <= time.monotonic():
                        break
                    wait = self._due[0][0] - time.monotonic() if self._due else None
                    self._cond.wait(wait)
                if self._closed:
                    return
                now = time.monotonic()
                batch = []
                while self._due and self._due[0][0] <= now:
                    batch.append(self._due.popleft()[1])
                self._busy = True
            try:
                for key in batch:
                    self._wait_turn()
                    try:
                        self._persist(key)
                        self.persisted += 1
                    except Exception:
                        log.exception("persisting chunk %s failed", key)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
