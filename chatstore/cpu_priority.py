"""The CPU class of the store's background threads: Linux's idle class while their work can wait.

The writer (a finished turn into DRAM) and the persister (DRAM chunks onto LMDB) copy tens of MB
a turn (a 2,000-token turn of the default model: ~70 ms of CPU). On a CPU host they share the
cores with the forward, whose OpenMP workers sleep between parallel regions. A background thread
of the normal class (SCHED_OTHER), even at nice 19, can take such a core while a worker sleeps
and keep it for the rest of its time slice once the worker wakes; the whole region then waits
for that one worker at its barrier (what the measurement below fits; not traced). In the idle
class (SCHED_IDLE) a waking thread of any other class preempts it at once (the kernel's wake-up
check), so it runs only on cores nothing else wants. Measured (2-core Zen 5, back-to-back fresh
2K prompts served, the classes switched between requests in one server, two runs): the forward
took 740 / 695 ms with the writer at nice 0 and the persister at nice 19, 715 / 685 ms with both
in the idle class.

Idle-class work can starve while the cores stay busy, and some of it must not: a turn the engine
blocks on (the write buffer's back-pressure), a session reply waiting for its turn's KV chain
(`TurnChain.take`), a delete waiting for the turn being saved, a chunk past its write-back
deadline. Those raise the thread to the normal class at its `nice` for as long as something waits
(`urgent()`, `urgent_after(deadline)`). Leaving the idle class needs CAP_SYS_NICE or a RLIMIT_NICE
that allows the nice value; where the process may not (probed once, `idle_class_reversible`), or
with CHATSTORE_IDLE_CLASS=0, the threads stay in the normal class at their nice value, as before,
and never enter a class they could not be raised from.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager

log = logging.getLogger(__name__)

_SCHED_IDLE = getattr(os, "SCHED_IDLE", None)
_SCHED_OTHER = getattr(os, "SCHED_OTHER", None)


def _own_nice() -> int:
    """The calling thread's nice value (Linux: PRIO_PROCESS 0 is the thread); 0 elsewhere."""
    try:
        return os.getpriority(os.PRIO_PROCESS, 0)
    except (OSError, AttributeError):
        return 0


@functools.cache
def idle_class_reversible() -> bool:
    """Whether this process may put a thread in the idle class and take it back out (Linux;
    root, CAP_SYS_NICE or a RLIMIT_NICE of 20). Probed in a thread of its own, which exits."""
    if os.environ.get("CHATSTORE_IDLE_CLASS", "1").lower() in ("0", "false", "no", "off"):
        return False
    if _SCHED_IDLE is None or _SCHED_OTHER is None or not hasattr(os, "sched_setscheduler"):
        return False
    ok: list[bool] = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, _SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(0, _SCHED_OTHER, os.sched_param(0))
            ok.append(True)
        except OSError:
            ok.append(False)

    thread = threading.Thread(target=probe, name="chatstore-sched-probe")
    thread.start()
    thread.join()
    return ok[0]


def _set_class(tid: int, idle: bool, nice: int | None) -> None:
    """Thread tid into the idle class, or the normal one at `nice`; None (or 0) leaves the
    thread's nice value as it is (the process's, or what it was given before: a change of class
    keeps it). Errors leave the thread as it is."""
    with contextlib.suppress(OSError, AttributeError, TypeError):
        if idle:
            os.sched_setscheduler(tid, _SCHED_IDLE, os.sched_param(0))  # type: ignore[arg-type]
            return
        if _SCHED_OTHER is not None and idle_class_reversible():
            os.sched_setscheduler(tid, _SCHED_OTHER, os.sched_param(0))
        if nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)


def _set_nice(tid: int, nice: int) -> None:
    """Thread tid in the normal class at exactly `nice` (lowering it needs what leaving the
    idle class needs). Errors leave the thread as it is."""
    _set_class(tid, idle=False, nice=None)
    with contextlib.suppress(OSError, AttributeError, TypeError):
        os.setpriority(os.PRIO_PROCESS, tid, nice)


class BackgroundPriority:
    """One background thread's class: idle while nothing waits on it, else normal at `nice`,
    or at the server's own nice while a thread of the server's waits for a lock it holds
    (`inherit()`: a write-back at nice 19 would hold such a waiter almost as long as an idle one).

    The thread calls `enter()` when it starts; any thread may then call `urgent()` or
    `inherit()` (contexts) or `urgent_after(deadline)` on it."""

    def __init__(self, nice: int = 0) -> None:
        self.nice = nice
        self.base_nice = _own_nice()  # the constructing (server's) thread's: what inherit() gives
        self._tid: int | None = None
        self._open = {"urgent": 0, "inherit": 0}  # urgent() and inherit() contexts open
        self._deadline: float | None = None  # urgent_after's, monotonic
        self._overdue = False  # that deadline has passed
        self._state = "idle"  # what the thread was last given: idle | urgent | inherit
        self._cond = threading.Condition()
        self._watchdog: threading.Thread | None = None
        self._closed = False

    @property
    def waited_on(self) -> bool:
        """Whether an `urgent()` or `inherit()` context is open (whatever the class allowed)."""
        with self._cond:
            return any(self._open.values())

    @property
    def idle_class(self) -> bool:
        """Whether the thread is in the idle class now."""
        with self._cond:
            return self._tid is not None and idle_class_reversible() and self._state == "idle"

    def enter(self) -> None:
        """The calling thread is the background thread: give it its class (normal if something
        waits on it already)."""
        with self._cond:
            self._tid = threading.get_native_id()
            if not idle_class_reversible():
                self._state = "urgent"
                _set_class(self._tid, idle=False, nice=self.nice)
                return
            self._state = ""  # nothing given yet: _apply gives what is wanted
            self._apply()

    def urgent(self) -> AbstractContextManager[None]:
        """While open (from any thread), the thread runs in the normal class at its nice."""
        return self._counted("urgent")

    def inherit(self) -> AbstractContextManager[None]:
        """While open, the thread runs in the normal class at `base_nice`: a thread of the
        server's waits for a lock this one holds (InheritingLock)."""
        return self._counted("inherit")

    @contextlib.contextmanager
    def _counted(self, kind: str) -> Iterator[None]:
        """One more open context of `kind` while open; the class follows the counts."""
        with self._cond:
            self._open[kind] += 1
            self._apply()
        try:
            yield
        finally:
            with self._cond:
                self._open[kind] -= 1
                self._apply()

    def urgent_after(self, deadline: float | None) -> None:
        """From `deadline` (time.monotonic()) on, until the next call, the thread runs in the
        normal class: the work it starts now must be done by then. None: no deadline."""
        with self._cond:
            self._deadline = deadline
            self._overdue = deadline is not None and deadline <= time.monotonic()
            armed = deadline is not None and not self._overdue and not self._closed
            if armed and idle_class_reversible():  # only an idle-class thread needs raising
                self._ensure_watchdog()
            self._apply()
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the deadline watchdog (the thread it watches is done)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            watchdog = self._watchdog
        if watchdog is not None:
            watchdog.join(5.0)

    def _apply(self) -> None:
        """Under the condition: the class the lock's waiters, the waiters and the deadline ask
        for. A nice value the thread held is set again when it leaves `inherit`."""
        if self._tid is None or not idle_class_reversible():
            return
        state = "idle"
        if self._open["inherit"]:
            state = "inherit"
        elif self._open["urgent"] or self._overdue:
            state = "urgent"
        if state == self._state:
            return
        was, self._state = self._state, state
        if state == "inherit":
            _set_nice(self._tid, self.base_nice)
        elif state == "urgent" and was == "inherit":
            _set_nice(self._tid, self.nice or self.base_nice)  # nice 0: as it was before
        else:
            _set_class(self._tid, idle=state == "idle", nice=self.nice)

    def _ensure_watchdog(self) -> None:
        if self._watchdog is None:
            name = "chatstore-priority-watchdog"
            self._watchdog = threading.Thread(target=self._watch, name=name, daemon=True)
            self._watchdog.start()

    def _watch(self) -> None:
        """Raise the thread when its deadline passes. The watchdog itself runs in the normal
        class (it must run while the cores are busy), not in the idle class it would inherit
        from the background thread that started it."""
        _set_class(threading.get_native_id(), idle=False, nice=0)
        with self._cond:
            while not self._closed:
                deadline = self._deadline
                if deadline is None or self._overdue:
                    self._cond.wait()
                    continue
                left = deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._overdue = True
                self._apply()


class InheritingLock:
    """A lock that idle-class threads hold through slow work (a commit's copies, a write-back's
    LMDB write). A thread that must wait for it raises the holder to the normal class while it
    waits (priority inheritance): else a turn's commit, and the reply waiting on it, waited for
    an idle-class write-back the forward kept off the cores (8 agents on 2 cores: 280 ms a
    commit, of which 21 ms on a CPU). A waiter that is itself an idle-class thread nobody waits
    on raises nobody. The holder is looked at again every `RECHECK_S`, so a waiter raised
    while it waits, or a lock passed to another holder meanwhile, is seen.

        with lock: ...                          any thread
        with lock.held_by(priority): ...        a background thread: whom a waiter raises
    """

    RECHECK_S = 0.05

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holder: BackgroundPriority | None = None

    def __enter__(self) -> None:
        self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    @contextlib.contextmanager
    def held_by(self, priority: BackgroundPriority | None) -> Iterator[None]:
        self.acquire(priority)
        try:
            yield
        finally:
            self.release()

    def acquire(self, priority: BackgroundPriority | None = None) -> None:
        """Take the lock; `priority`: the calling background thread's, when it is one."""
        if not self._lock.acquire(blocking=False):
            with contextlib.ExitStack() as raising:
                raised: BackgroundPriority | None = None
                while True:
                    holder = self._holder
                    if priority is not None and priority.idle_class:
                        holder = None  # nobody waits on the waiter: it raises nobody
                    if holder is not raised:  # raised for as long as it holds the lock
                        raising.close()
                        if holder is not None:
                            raising.enter_context(holder.inherit())
                        raised = holder
                    if self._lock.acquire(timeout=self.RECHECK_S):
                        break
        self._holder = priority

    def release(self) -> None:
        self._holder = None
        self._lock.release()


def describe_background_class() -> str:
    """One line for the start log: which class the background threads use."""
    if idle_class_reversible():
        return "background store threads: idle CPU class (the forward preempts them at once)"
    return "background store threads: normal CPU class (idle class off or not permitted)"
