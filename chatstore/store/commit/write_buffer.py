"""Asynchronous save with a write buffer (CachedAttention §3.2.2).

The engine thread hands a finished turn to `WriteBuffer.submit` and goes on with the next step;
one writer thread builds the turn's SessionKV and commits it to the tiers, in submission order.

    engine thread:  request_finished ──submit(key, build, nbytes)──► [ write buffer ] ──► writer
    writer thread:  value = build(); commit(key, value)      (DRAM put, LMDB in one transaction)

Visibility: a key is "pending" from `submit` until its commit returned. A reader that wants the
session's newest turn asks `peek(key)` first: the value of the newest pending job, built on
demand. A job's build runs once (memoized, under the job's own lock): whichever thread needs the
value first — the writer about to commit it, or a reader — builds it, the other reuses it, so
the reader gets exactly the value the writer commits, without waiting for the commits queued
before it (an LMDB write of a long session takes 50-300 ms). `wait(key)` waits for the commit
itself (readers that need the stored state: tier, record). Either way a reader sees the previous
complete KV only if it asks before `submit`, and the new complete KV after it — never a torn one
(each tier's put is atomic: DRAM under the hierarchy lock, LMDB in one write txn).

Back-pressure: the buffer holds at most `capacity_bytes` of pending turns; `submit` blocks the
caller (the engine thread) until the writer has drained enough. A single turn larger than the
whole buffer is accepted once the buffer is empty, so nothing waits forever.

CPU: the writer's torch ops run on `intra_op_threads` (1) threads of their own. Left at the
process setting, each of its big copies starts a second OpenMP team as wide as the engine's,
and on a CPU host the two teams fight over the same cores: measured with bench/save.py on 2
cores, async save cost ~10% per request that way, ~2-3% with one writer thread. The thread runs
in Linux's idle CPU class while nobody waits on it, so the forward's OpenMP workers preempt it at
once (chatstore/cpu_priority.py); a submit held by back-pressure, `wait`, `flush` and `close` raise
it to the normal class at `nice` (0) while they wait.

Deferring to a prefill (`idle`, `max_defer_s`): a commit nobody waits for starts once the running
prefill's forward ends, or after at most `max_defer_s`; one something waits on
(`priority.urgent()`: a session reply's last frame waits for its turn's chain) starts at once.
Under load the engine prefills nearly all the time, and each queued commit used to sit out its
0.5 s in turn: with 8 agents a reply ended 0.94 s after its last token on average.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from chatstore.cpu_priority import BackgroundPriority
from chatstore.cpu_threads import own_intra_op_threads

log = logging.getLogger(__name__)


_UNBUILT = object()


@dataclass(eq=False)
class _Job:
    key: Hashable
    build: Callable[[], object]
    nbytes: int
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _value: object = field(default=_UNBUILT, repr=False)
    _error: BaseException | None = field(default=None, repr=False)

    def value(self) -> object:
        """build(), run once whichever thread asks first; later callers get the same object
        (or the same exception)."""
        with self._lock:
            if self._value is _UNBUILT and self._error is None:
                try:
                    self._value = self.build()
                except BaseException as exc:  # re-raised to every caller
                    self._error = exc
            if self._error is not None:
                raise self._error
            return self._value


class WriteBuffer:
    DEFER_SLICE_S = 0.01

    def __init__(
        self,
        commit: Callable[[Hashable, object], None],
        capacity_bytes: int = 1 << 30,
        name: str = "chatstore-writer",
        nice: int = 0,
        intra_op_threads: int | None = 1,
    ) -> None:
        self._commit = commit
        self.capacity_bytes = capacity_bytes
        self._name = name
        # idle CPU class while nobody waits on the writer, else normal at nice (cpu_priority.py)
        self.priority = BackgroundPriority(nice)
        self.idle: threading.Event | None = None  # set by the store: clear while prefilling
        self.max_defer_s = 0.5
        self._intra_op_threads = intra_op_threads
        self._jobs: deque[_Job] = deque()
        self._pending: dict[Hashable, int] = {}  # key -> jobs not yet committed
        self._bytes = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.writes = 0
        self.failures = 0
        self.stalls = 0  # submits that had to wait for room (back-pressure)

    @property
    def pending_bytes(self) -> int:
        with self._cond:
            return self._bytes

    def submit(self, key: Hashable, build: Callable[[], object], nbytes: int) -> None:
        """Queue one write; blocks while the buffer is full (see module doc), unless it adds no
        bytes (a record write: the event loop may queue one)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("write buffer is closed")
            if nbytes and self._bytes and self._bytes + nbytes > self.capacity_bytes:
                self.stalls += 1
                with self.priority.urgent():  # the engine thread waits on the writer
                    self._cond.wait_for(
                        lambda: not self._bytes or self._bytes + nbytes <= self.capacity_bytes
                    )
            self._jobs.append(_Job(key, build, nbytes))
            self._pending[key] = self._pending.get(key, 0) + 1
            self._bytes += nbytes
            self._ensure_thread()
            self._cond.notify_all()

    def is_pending(self, key: Hashable) -> bool:
        with self._cond:
            return key in self._pending

    def peek(self, key: Hashable) -> object | None:
        """The value of the newest pending (not yet committed) job of `key`, or None when
        none is pending or its build failed. Built here if the writer has not built it yet
        (then the writer commits this very object). Treat it as read-only."""
        with self._cond:
            job = next((j for j in reversed(self._jobs) if j.key == key), None)
        if job is None:
            return None
        try:
            return job.value()
        except Exception:
            return None  # the writer logs the failure; the caller falls back to the store

    def wait(self, key: Hashable, timeout: float | None = None) -> bool:
        """Until no write of `key` is pending; False on timeout."""
        with self._cond, self.priority.urgent():
            return self._cond.wait_for(lambda: key not in self._pending, timeout)

    def flush(self, timeout: float | None = None) -> bool:
        """Until every submitted write is committed; False on timeout."""
        with self._cond, self.priority.urgent():
            return self._cond.wait_for(lambda: not self._pending, timeout)

    def close(self) -> None:
        """Commit what is pending, then stop the writer thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            with self.priority.urgent():
                thread.join()

    # -- the writer thread -------------------------------------------------------------------

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def _wait_turn(self) -> None:
        """While the engine runs a prefill (`idle` clear), wait, at most `max_defer_s`: its
        TTFT is what a user waits for, the write is not (readers get pending turns from the
        buffer). Closing, or something waiting on the writer (`priority.urgent()`), ends the
        waiting; the idle event is the store's, so that is looked at every `DEFER_SLICE_S`."""
        idle = self.idle
        if idle is None:
            return
        deadline = time.monotonic() + self.max_defer_s
        while not self._closed and not self.priority.waited_on:
            left = deadline - time.monotonic()
            if left <= 0 or idle.wait(min(left, self.DEFER_SLICE_S)):
                return

    def _run(self) -> None:
        if self._intra_op_threads:
            own_intra_op_threads(self._intra_op_threads)
        self.priority.enter()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._closed)
                if not self._jobs:
                    return  # closed and drained
                job = self._jobs[0]
            self._wait_turn()
            try:
                self._commit(job.key, job.value())
                ok = True
            except Exception:
                log.exception("async save of %s failed", job.key)
                ok = False
            with self._cond:
                self._jobs.popleft()
                self._bytes -= job.nbytes
                left = self._pending[job.key] - 1
                if left:
                    self._pending[job.key] = left
                else:
                    del self._pending[job.key]
                self.writes += ok
                self.failures += not ok
                self._cond.notify_all()
            del job  # do not keep the last turn's KV alive while idle
