"""copy_events.py on a CPU: the implementation the CPU path runs (threading.Events set once a
copy has finished, no compute mark, nothing to keep alive). The loader's ordering through it is
checked end to end in test_layerwise_preload.py (no layer is read before its copy finished);
the CUDA implementation (events, wait_event, record_stream) needs a GPU."""

from __future__ import annotations

import threading
import time

import torch

from chatstore.transfer.copy_events import compute_mark, keep_for, layer_events, order_after


def test_the_cpu_implementation_is_threading_events_and_no_mark() -> None:
    cpu = torch.device("cpu")
    events = layer_events(cpu, 3)
    assert len(events) == 3 and all(type(e) is threading.Event for e in events)
    assert len({id(e) for e in events}) == 3
    assert compute_mark(cpu) is None


def test_a_waiter_sees_the_copy_its_layer_signals() -> None:
    """The forward's side: wait() returns only after the copying thread set the layer, and
    the copy made before set() is visible then."""
    (done,) = layer_events(torch.device("cpu"), 1)
    pool = torch.zeros(4)
    started = threading.Event()

    def copier() -> None:
        started.set()
        time.sleep(0.05)
        pool.copy_(torch.arange(4.0))
        done.set()

    thread = threading.Thread(target=copier)
    thread.start()
    started.wait()
    assert not done.is_set()
    done.wait()
    assert pool.tolist() == [0.0, 1.0, 2.0, 3.0]
    thread.join()


def test_order_and_keep_leave_cpu_work_alone() -> None:
    """No stream exists on a CPU: ordering after no mark and keeping CPU tensors do nothing."""
    t = torch.ones(2)

    class NoStream:
        def wait_event(self, _: object) -> None:
            raise AssertionError("a CPU load has nothing to wait for")

    order_after(NoStream(), None)  # type: ignore[arg-type]
    keep_for(NoStream(), t)  # type: ignore[arg-type]
    assert t.tolist() == [1.0, 1.0]
