"""One thread that runs slow-tier work handed off by a thread that must not wait for it.

The engine thread's reads may promote a chunk to DRAM and so evict another that has no copy
below; writing that victim down (LMDB, maybe Redis) is queued here instead of run on the
engine thread. Jobs run in submission order; `drain` waits for all of them (shutdown, tests).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from chatstore.cpu_threads import own_intra_op_threads

log = logging.getLogger(__name__)

IDLE_EXIT_S = 10.0  # the thread ends after this long without work (a store may be dropped)


class BackgroundIO:
    def __init__(self, name: str = "chatstore-tiers-io") -> None:
        self._name = name
        self._jobs: deque[Callable[[], None]] = deque()
        self._busy = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], None]) -> None:
        with self._cond:
            self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Until every submitted job has run; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and not self._busy, timeout)

    def _run(self) -> None:
        # Encoding chunks copies tensors: one intra-op thread, beside the engine's team.
        own_intra_op_threads(1)
        while True:
            with self._cond:
                if not self._cond.wait_for(lambda: bool(self._jobs), IDLE_EXIT_S):
                    self._thread = None  # the next submit starts another
                    return
                job = self._jobs.popleft()
                self._busy = True
            try:
                job()
            except Exception:
                log.exception("background tier job failed")
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
