"""Write-back of completed chunks to the SSD tier (`persist = "write_back"`), so that a server
killed with -9 restarts warm.

A chunk stored in DRAM is copied to LMDB at most `lag_s` seconds later, off the engine thread,
in batches: a turn's chunks usually arrive together and are written together. A chunk is due
`lag_s / 2` after it was stored; from then until its deadline (`lag_s` after) each copy waits
for a moment without a prefill (at most `max_defer_s`), and past its deadline it waits for
nothing: under sustained load there is no such moment, and deferring every chunk would let
LMDB fall behind without bound (a kill -9 after 15 s of back-to-back turns once found nothing
of them on SSD). The copy is left
in DRAM (chunks are immutable: both copies are valid). The session record already lists the
chunk; until its copy lands a crash loses only that chunk, and the session reloads up to it.

A copy the tier refuses (its LMDB map or disk is full: `persist` returns False) is tried again
later; the chunk stays in DRAM meanwhile. The tier is then full for every chunk, so the rest of
the batch and every chunk due meanwhile wait with it: nothing is tried until `retry_s` has
passed, doubling (up to `max_retry_s`) while the tier keeps refusing, back to `retry_s` after a
copy lands. With `persist = "write_through"` the writer copies each chunk itself and hands only
the refused ones here (`retry`).

The thread copies in Linux's idle CPU class, so the forward's OpenMP workers preempt it at once
(chatstore/cpu_priority.py), and is raised to the normal class at nice 19 when a copy runs past
its chunk's deadline (a flushed or retried chunk's is now): the lag bound holds under load.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from chatstore.cpu_priority import BackgroundPriority
from chatstore.cpu_threads import own_intra_op_threads
from chatstore.store.session_kv import ChunkKey

log = logging.getLogger(__name__)


class Persister:
    def __init__(
        self,
        persist: Callable[[ChunkKey], bool | None],
        lag_s: float,
        retry_s: float = 1.0,
        max_retry_s: float = 60.0,
        before_copy: Callable[[], object] = lambda: None,
    ) -> None:
        """persist(key) copies one chunk down; False means "not taken, try again later".
        before_copy: run before each copy (the committer touches the shared chunks in use in
        Redis, so that the chunk about to land there, not them, is what its LRU evicts)."""
        self._persist = persist
        self._before_copy = before_copy
        self.lag_s = lag_s
        self.retry_s = retry_s
        self.max_retry_s = max_retry_s
        self._due: deque[tuple[float, ChunkKey]] = deque()  # (due, key), due order
        self._retry: dict[ChunkKey, None] = {}  # refused chunks (and those waiting with them)
        self._retry_at = 0.0  # when they are tried again
        self._refusals = 0  # consecutive failed tries: the backoff's exponent
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._busy = False
        self.persisted = 0
        self.refused = 0  # copies the tier did not take (each was tried again later)
        self.idle: threading.Event | None = None
        self.max_defer_s = 0.5
        # idle CPU class while a copy is within its deadline, nice 19 past it (cpu_priority.py)
        self.priority = BackgroundPriority(nice=19)

    def add(self, key: ChunkKey) -> None:
        with self._cond:
            if self._closed:
                return
            self._due.append((time.monotonic() + self.lag_s / 2, key))
            self._wake()

    def retry(self, key: ChunkKey) -> None:
        """A copy of key was refused elsewhere (write_through): try it with the next retry."""
        with self._cond:
            if self._closed:
                return
            self.refused += 1
            if not self._retry:
                self._retry_at = time.monotonic() + self._backoff()
                self._refusals += 1
            self._retry[key] = None
            self._wake()

    def backing_off(self) -> bool:
        """Whether refused copies are waiting for their retry (the tier is full)."""
        with self._cond:
            return bool(self._retry) and self._retry_at > time.monotonic()

    def retrying(self) -> int:
        """Chunks waiting for a retry (only in DRAM until it succeeds)."""
        with self._cond:
            return len(self._retry)

    def _wake(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="chatstore-persist", daemon=True)
            self._thread.start()
        self._cond.notify_all()

    def _backoff(self) -> float:
        return min(self.max_retry_s, self.retry_s * 2 ** min(self._refusals, 30))

    def flush(self, timeout: float | None = None) -> bool:
        """Persist everything queued now, not waiting for its lag nor a retry's backoff; False
        on timeout. What the tier refuses again waits for its retry (flush does not wait)."""
        with self._cond:
            retry = [(0.0, key) for key in self._retry]
            self._retry.clear()
            self._due = deque([*retry, *((0.0, key) for _, key in self._due)])
            self._cond.notify_all()
            return self._cond.wait_for(lambda: not self._due and not self._busy, timeout)

    def pending(self) -> int:
        with self._cond:
            return len(self._due) + len(self._retry) + self._busy

    def close(self, flush: bool = True) -> None:
        if flush:
            self.flush(60.0)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(5.0)
        self.priority.close()

    def _wait_turn(self, deadline: float) -> None:
        """Let a running prefill finish first (see WriteBuffer): at most max_defer_s, and never
        past the chunk's deadline."""
        idle = self.idle
        wait = min(self.max_defer_s, deadline - time.monotonic())
        if idle is not None and not self._closed and wait > 0:
            idle.wait(wait)

    def _next_batch(self) -> list[tuple[float, ChunkKey]] | None:
        """Under the condition: wait for the chunks due now (None once closed). While refused
        copies wait for their retry, chunks coming due join them instead. Each chunk comes
        with its deadline (a retried or flushed one: now)."""
        while not self._closed:
            now = time.monotonic()
            batch: list[tuple[float, ChunkKey]] = []
            if self._retry and self._retry_at <= now:
                batch = [(now, key) for key in self._retry]
                self._retry.clear()
            while self._due and self._due[0][0] <= now:
                due, key = self._due.popleft()
                if self._retry:  # still backing off
                    self._retry[key] = None
                else:
                    batch.append((due + self.lag_s / 2, key))
            if batch:
                return batch
            times = [self._due[0][0]] if self._due else []
            if self._retry:
                times.append(self._retry_at)
            self._cond.wait(min(times) - now if times else None)
        return None

    def _run(self) -> None:
        own_intra_op_threads(1)
        self.priority.enter()  # background work with a lag budget
        while True:
            with self._cond:
                batch = self._next_batch()
                if batch is None:
                    return
                self._busy = True
            try:
                self._copy(batch)
            finally:
                self.priority.urgent_after(None)
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _copy(self, batch: list[tuple[float, ChunkKey]]) -> None:
        for i, (deadline, key) in enumerate(batch):
            self._wait_turn(deadline)
            self.priority.urgent_after(deadline)  # raised if the copy runs past its deadline
            try:
                self._before_copy()
            except Exception:
                log.exception("before a write-back copy")
            try:
                taken = self._persist(key) is not False
            except Exception:
                log.exception("persisting chunk %s failed", key)
                continue
            if taken:
                self.persisted += 1
                self._refusals = 0
                continue
            with self._cond:  # the tier is full: this chunk and the rest wait for the retry
                self.refused += 1
                delay = self._backoff()
                self._refusals += 1
                self._retry_at = time.monotonic() + delay
                for _, rest in batch[i:]:
                    self._retry[rest] = None
            log.info(
                "write-back refused (the tier is full): %d chunks stay in DRAM, retry in %.1f s",
                len(batch) - i, delay,
            )  # fmt: skip
            return
