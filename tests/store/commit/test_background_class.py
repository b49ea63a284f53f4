"""The store's background threads run in Linux's idle CPU class while nothing waits on them, and
in the normal class at their nice value while something does (chatstore/cpu_priority.py): a
submit held by back-pressure, a wait for a turn, a write-back copy past its deadline. Where the
process may not leave the idle class again they never enter it."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from chatstore import cpu_priority
from chatstore.cpu_priority import BackgroundPriority, idle_class_reversible
from chatstore.store.commit.persister import Persister
from chatstore.store.commit.write_buffer import WriteBuffer
from chatstore.store.opened_turn import TurnChain
from chatstore.store.session_kv import ChunkKey

linux_idle_class = pytest.mark.skipif(
    not idle_class_reversible(), reason="this process may not leave the idle class again"
)


def cpu_class(tid: int) -> tuple[str, int]:
    """('idle' | 'normal' | other policy, nice) of thread tid."""
    policy = os.sched_getscheduler(tid)
    name = {os.SCHED_IDLE: "idle", os.SCHED_OTHER: "normal"}.get(policy, str(policy))
    return name, os.getpriority(os.PRIO_PROCESS, tid)


def wait_until(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def background_thread() -> Iterator[Callable[[BackgroundPriority], int]]:
    """Start a thread that enters the given class and idles until the test ends; its tid."""
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def start(priority: BackgroundPriority) -> int:
        tid: list[int] = []

        def run() -> None:
            priority.enter()
            tid.append(threading.get_native_id())
            stop.wait()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        threads.append(thread)
        assert wait_until(lambda: bool(tid))
        return tid[0]

    yield start
    stop.set()
    for thread in threads:
        thread.join(5.0)


@linux_idle_class
def test_idle_until_a_waiter_raises_it_to_its_nice(background_thread) -> None:
    priority = BackgroundPriority(nice=7)
    tid = background_thread(priority)
    assert cpu_class(tid)[0] == "idle" and priority.idle_class
    with priority.urgent():
        assert cpu_class(tid) == ("normal", 7)
        with priority.urgent():  # a second waiter: still raised when the inner one leaves
            pass
        assert cpu_class(tid) == ("normal", 7)
    assert cpu_class(tid)[0] == "idle"


@linux_idle_class
def test_a_deadline_raises_the_thread_when_it_passes(background_thread) -> None:
    priority = BackgroundPriority(nice=19)
    tid = background_thread(priority)
    start = time.monotonic()
    priority.urgent_after(start + 0.3)
    assert cpu_class(tid)[0] == "idle"
    assert wait_until(lambda: cpu_class(tid)[0] == "normal")
    assert time.monotonic() - start >= 0.3 - 0.01
    assert cpu_class(tid) == ("normal", 19)
    priority.urgent_after(None)  # the work is done
    assert cpu_class(tid)[0] == "idle"
    priority.urgent_after(time.monotonic() - 1.0)  # already late: raised at once
    assert cpu_class(tid) == ("normal", 19)
    priority.close()


def test_without_permission_the_thread_stays_normal_at_its_nice(
    background_thread, monkeypatch
) -> None:
    monkeypatch.setattr(cpu_priority, "idle_class_reversible", lambda: False)
    priority = BackgroundPriority(nice=19)
    tid = background_thread(priority)
    assert cpu_class(tid) == ("normal", 19) and not priority.idle_class
    priority.urgent_after(time.monotonic() + 0.05)
    with priority.urgent():
        assert cpu_class(tid) == ("normal", 19)
    time.sleep(0.1)
    assert cpu_class(tid) == ("normal", 19)


def test_the_environment_turns_the_idle_class_off(monkeypatch) -> None:
    monkeypatch.setenv("CHATSTORE_IDLE_CLASS", "0")
    idle_class_reversible.cache_clear()
    try:
        assert idle_class_reversible() is False
        assert "normal CPU class" in cpu_priority.describe_background_class()
    finally:
        monkeypatch.delenv("CHATSTORE_IDLE_CLASS")
        idle_class_reversible.cache_clear()


@linux_idle_class
def test_write_back_copies_idle_within_their_deadline_and_normal_past_it() -> None:
    seen: dict[str, tuple[str, int]] = {}

    def persist(key: ChunkKey) -> bool:
        seen[key.digest[-1]] = cpu_class(threading.get_native_id())
        return True

    persister = Persister(persist, lag_s=2.0)
    persister.add(ChunkKey("t", "0" * 32))  # due at 1 s, deadline 2 s: copied in time
    assert wait_until(lambda: "0" in seen)
    persister.add(ChunkKey("t", "0" * 31 + "1"))
    persister.flush(10.0)  # a flush wants it now: past any deadline
    watchdog = [t for t in threading.enumerate() if t.name == "chatstore-priority-watchdog"]
    assert watchdog and cpu_class(watchdog[-1].native_id)[0] == "normal"  # not inherited idle
    persister.close(flush=False)
    assert seen["0"][0] == "idle"
    assert seen["1"] == ("normal", 19)
    assert not watchdog[-1].is_alive()


@linux_idle_class
def test_the_writer_is_raised_while_someone_waits_for_its_turn() -> None:
    release = threading.Event()
    classes: list[tuple[str, int]] = []
    tid: list[int] = []

    def commit(key: object, value: object) -> None:
        tid.append(threading.get_native_id())
        release.wait(10.0)
        classes.append(cpu_class(tid[0]))

    writer = WriteBuffer(commit, capacity_bytes=1 << 20)
    writer.submit("turn", lambda: "kv", 10)
    assert wait_until(lambda: bool(tid))
    assert cpu_class(tid[0])[0] == "idle"  # nobody waits: it may take as long as it likes
    waiter = threading.Thread(target=writer.wait, args=("turn", 10.0))
    waiter.start()
    assert wait_until(lambda: cpu_class(tid[0])[0] == "normal")
    release.set()
    waiter.join(10.0)
    assert classes == [("normal", 0)]
    assert wait_until(lambda: cpu_class(tid[0])[0] == "idle")
    writer.close()


@linux_idle_class
def test_the_writer_is_raised_while_a_reply_waits_for_its_turns_chain() -> None:
    """A session turn's reply ends only once the store's commit has given it the turn's KV
    chain (TurnChain.take): an idle-class writer starved by the forward held replies back for
    seconds under load (bench/agentic.py: 4.5 s from the last token to the stream's end)."""
    release = threading.Event()
    tid: list[int] = []

    def commit(key: object, value: object) -> None:
        tid.append(threading.get_native_id())
        release.wait(10.0)

    writer = WriteBuffer(commit)
    chain = TurnChain(writer.priority.urgent)
    writer.submit("turn", lambda: "kv", 10)
    assert wait_until(lambda: bool(tid))
    assert cpu_class(tid[0])[0] == "idle"
    taker = threading.Thread(target=chain.take, args=(10.0,))
    taker.start()
    assert wait_until(lambda: cpu_class(tid[0])[0] == "normal")
    chain.complete(None)
    taker.join(10.0)
    assert cpu_class(tid[0])[0] == "idle"  # the reply has its chain: nobody waits any more
    release.set()
    writer.close()


def test_a_completed_chain_is_taken_without_hurrying() -> None:
    entered: list[bool] = []

    class Hurry:
        def __enter__(self) -> None:
            entered.append(True)

        def __exit__(self, *exc: object) -> None:
            return None

    chain = TurnChain(Hurry)
    chain.complete(None)
    assert chain.take(1.0) is None and not entered
    waiting = TurnChain(Hurry)
    assert waiting.take(0.01) is None and entered == [True]  # waited (and timed out)


def test_a_commit_someone_waits_for_does_not_defer_to_a_prefill() -> None:
    """The writer lets a running prefill go first (`idle` clear) for up to `max_defer_s`,
    unless something waits on it: under load the engine prefills nearly all the time, and each
    reply sat out its commit's deferral (8 agents: 0.94 s from the last token to the end)."""
    done = threading.Event()
    writer = WriteBuffer(lambda key, value: done.set())
    writer.idle = threading.Event()  # a prefill that never ends
    writer.max_defer_s = 60.0
    writer.submit("turn", lambda: "kv", 10)
    assert not done.wait(0.3)  # nobody waits: it defers
    start = time.monotonic()
    assert writer.wait("turn", timeout=20.0)
    assert time.monotonic() - start < 20.0 and done.is_set()
    writer.idle.set()
    writer.close()


PROBE = "from chatstore.cpu_priority import idle_class_reversible as r; print(r())"


@pytest.mark.skipif(os.geteuid() != 0, reason="drops a capability root has")
@pytest.mark.skipif(not shutil.which("setpriv"), reason="setpriv (util-linux) missing")
def test_without_cap_sys_nice_the_rlimit_decides() -> None:
    """A server without CAP_SYS_NICE (a container's non-root user) may leave the idle class
    again only where RLIMIT_NICE lets a thread back to nice 0 (>= 20, the kernel's rule in
    sched(7)); at a container's default of 0 its threads keep the normal class. Run here as
    root with CAP_SYS_NICE dropped from the bounding set (this machine may not raise the
    rlimit: no CAP_SYS_RESOURCE, so only the answer for its own limit is checked)."""
    import resource
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "CHATSTORE_IDLE_CLASS"}
    drop = ["setpriv", "--bounding-set=-sys_nice", "--inh-caps=-sys_nice", "--"]
    ran = subprocess.run(
        [*drop, sys.executable, "-c", PROBE],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    allowed = soft == resource.RLIM_INFINITY or soft >= 20
    assert ran.stdout.split() == [str(allowed)]
