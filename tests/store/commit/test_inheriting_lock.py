"""The committer's `mutate` lock is held by the store's writer and write-back in the idle CPU
class (chatstore/cpu_priority.py). A thread of the server's that must wait for it raises the
holder to the normal class at the server's own nice value while it waits (priority inheritance):
without that a turn's commit, and the reply waiting on it, waited for a write-back the forward
kept off the cores (8 agents on 2 cores: a commit took 280 ms of which 21 ms ran on a CPU, and
replies ended 0.94 s after their last token)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from chatstore.cpu_priority import BackgroundPriority, InheritingLock
from tests.store.commit.test_background_class import cpu_class, linux_idle_class, wait_until


class Holder:
    """A background thread that takes the lock under its priority and holds it until told."""

    def __init__(self, lock: InheritingLock, priority: BackgroundPriority) -> None:
        self.release, self.leave = threading.Event(), threading.Event()
        self.holding, self.tid = threading.Event(), 0
        self._lock, self._priority = lock, priority
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.holding.wait(10.0)

    def _run(self) -> None:
        self._priority.enter()
        self.tid = threading.get_native_id()
        with self._lock.held_by(self._priority):
            self.holding.set()
            self.release.wait(10.0)
        self.leave.wait(10.0)  # alive after the release: its class is looked at then

    def stop(self) -> None:
        self.release.set()
        self.leave.set()
        self.thread.join(10.0)


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    started: list[Holder] = []
    yield started
    for holder in started:
        holder.stop()


def waiter(lock: InheritingLock, priority: BackgroundPriority | None = None) -> threading.Event:
    got = threading.Event()

    def run() -> None:
        if priority is not None:
            priority.enter()
        lock.acquire(priority)
        got.set()
        lock.release()

    threading.Thread(target=run, daemon=True).start()
    return got


@linux_idle_class
def test_a_waiter_raises_the_idle_holder_to_the_servers_nice(holders) -> None:
    lock, priority = InheritingLock(), BackgroundPriority(nice=19)
    holder = Holder(lock, priority)
    holders.append(holder)
    assert cpu_class(holder.tid)[0] == "idle"
    got = waiter(lock)
    assert wait_until(lambda: cpu_class(holder.tid) == ("normal", priority.base_nice))
    assert not got.is_set()
    holder.release.set()
    assert got.wait(10.0)
    assert wait_until(lambda: cpu_class(holder.tid)[0] == "idle")  # nobody waits any more


@linux_idle_class
def test_an_urgent_holder_goes_back_to_its_own_nice_after_the_waiter(holders) -> None:
    lock, priority = InheritingLock(), BackgroundPriority(nice=19)
    holder = Holder(lock, priority)
    holders.append(holder)
    with priority.urgent():  # e.g. a write-back past its deadline
        assert cpu_class(holder.tid) == ("normal", 19)
        got = waiter(lock)
        assert wait_until(lambda: cpu_class(holder.tid) == ("normal", priority.base_nice))
        holder.release.set()
        assert got.wait(10.0)
        assert wait_until(lambda: cpu_class(holder.tid) == ("normal", 19))


@linux_idle_class
def test_an_idle_class_waiter_raises_nobody(holders) -> None:
    lock, holder_priority = InheritingLock(), BackgroundPriority(nice=19)
    holder = Holder(lock, holder_priority)
    holders.append(holder)
    got = waiter(lock, BackgroundPriority())  # another background thread nobody waits on
    time.sleep(InheritingLock.RECHECK_S * 4)
    assert cpu_class(holder.tid)[0] == "idle" and not got.is_set()
    holder.release.set()
    assert got.wait(10.0)


def test_the_lock_excludes_and_works_as_a_plain_context() -> None:
    lock, inside, most = InheritingLock(), [0], [0]

    def work() -> None:
        for _ in range(200):
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
                inside[0] -= 1

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30.0)
    assert most[0] == 1
    with lock.held_by(None):
        assert not lock._lock.acquire(blocking=False)
    assert lock._lock.acquire(blocking=False)
    lock._lock.release()
