"""One OpenMP team per server process: the engine thread's.

torch's CPU ops (and MKL) run on libgomp, which gives every thread that starts a parallel
region its own pool of worker threads. Once the pools hold more threads than there are cores,
libgomp stops letting idle workers spin and puts them to sleep after ~1,000 iterations, so each
parallel region pays a futex wake-up: measured here (2 cores), a [1, 576] x [576, 3072] fp32
matmul took 122 us from the only thread using OpenMP and ~195 us from any thread once a second
one had used it, and the served decode at batch 1 ran at 29 tok/s against 45 tok/s for the same
engine in the main thread. So the server builds the model in a short-lived thread (whose pool
goes when it exits), leaves every other thread at one intra-op thread (no pool at all), and the
engine thread alone computes on all cores.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def in_temporary_thread(fn: Callable[..., T], *args: object) -> T:
    """fn(*args) run in a thread that exits afterwards, taking its OpenMP pool with it."""
    out: list[T] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn(*args))
        except BaseException as exc:  # re-raised in the caller
            err.append(exc)

    thread = threading.Thread(target=run, name="chatstore-build")
    thread.start()
    thread.join()
    if err:
        raise err[0]
    return out[0]


def leave_cores_to_engine() -> int:
    """Make this thread and threads started after it use one intra-op thread; returns the count
    the engine thread should take (what torch had: the machine's cores by default)."""
    cores = torch.get_num_threads()
    torch.set_num_threads(1)
    return cores


def own_intra_op_threads(n: int) -> None:
    """This thread's torch ops on n intra-op threads; the process setting (the engine thread,
    threads started later) is put back. torch keeps the size per thread once a thread has
    used it, and takes it from one process-wide value the first time: set, use, restore."""
    before = torch.get_num_threads()
    if before == n:
        return
    torch.set_num_threads(n)
    torch.get_num_threads()  # this thread's pool size is fixed now, at n
    restore = threading.Thread(target=torch.set_num_threads, args=(before,), daemon=True)
    restore.start()
    restore.join()
