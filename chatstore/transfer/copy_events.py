"""How the forward and the layer loader order each other's work, on any device.

    engine thread (compute)                     a copying thread (loader, or the forward
                                                taking a layer itself)
    start_load: mark = compute_mark(device) ──► copies of the load begin after `mark`
                                                (blocks freed and reused, copy-on-write)
    wait_for_layer(i): done[i].wait()       ◄── copy layer i; done[i].set()

    CPU   the work of both sides is synchronous host work on threads: no mark is needed (all
          compute before the submit has run), and `done` is a threading.Event set once the
          copy has finished: wait() blocks until then. This is what the CPU path has always
          used.
    CUDA  the copies run on the loader's stream: that stream waits on `mark` (an event
          recorded on the compute stream), and done[i].set() records an event on it after the
          copy; wait() blocks the host only until that event is *recorded* (the copy enqueued,
          microseconds), then makes the compute stream wait on it (`wait_event`): the GPU
          orders layer i's attention after its copy, and no host thread waits for the copy.

Buffers that cross streams live until their event completes: a device tensor made on the
compute stream and read on the copy stream is `record_stream`-ed there (`keep_for`), so the
caching allocator does not hand its memory out before the copy stream is done with it. Host
memory a copy reads or writes (a staging-ring slot, the DRAM pool's leased blocks) is given
back only once a `CopyFence` recorded after the copy reports it done:

    CopyFence   query() -> the copy has run; synchronize() -> block until it has
    CUDA        a torch.cuda.Event recorded on the copying stream (it has this very interface)
    CPU         HostFence, a threading.Event: a CPU copy is synchronous, so `fence_after_copy`
                hands out one already set; tests set their own later to hold a copy "in flight"
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Protocol

import torch


class LayerDone(Protocol):
    """Completion of one layer's copy, as the forward waits for it."""

    def set(self) -> None: ...  # the copying thread, once the layer's copy is issued
    def is_set(self) -> bool: ...
    def wait(self) -> object: ...  # the forward, before the layer's attention


class CudaLayerDone:
    """An event recorded on the copying thread's current stream, waited on by the compute
    stream of the thread that waits."""

    def __init__(self) -> None:
        self._recorded = threading.Event()
        self._event = torch.cuda.Event()

    def set(self) -> None:
        self._event.record()  # on the copying thread's current stream: the loader's
        self._recorded.set()

    def is_set(self) -> bool:
        return self._recorded.is_set()

    def wait(self) -> None:
        self._recorded.wait()
        torch.cuda.current_stream().wait_event(self._event)

    def finished(self) -> bool:
        """Whether the copy itself has run (for tests and stats; nothing waits on this)."""
        return self._recorded.is_set() and self._event.query()


def layer_events(device: torch.device, layers: int) -> list[LayerDone]:
    """One completion per layer: CUDA events on CUDA, threading.Events elsewhere."""
    if device.type == "cuda":
        return [CudaLayerDone() for _ in range(layers)]
    return [threading.Event() for _ in range(layers)]


def compute_mark(device: torch.device) -> torch.cuda.Event | None:
    """What a load's copies must come after: an event on the compute stream (CUDA); None on a
    CPU, whose compute up to now has already run."""
    if device.type != "cuda":
        return None
    mark = torch.cuda.Event()
    mark.record()
    return mark


def order_after(stream: torch.cuda.Stream, mark: torch.cuda.Event | None) -> None:
    """Work enqueued on `stream` from now on starts after `mark`."""
    if mark is not None:
        stream.wait_event(mark)


def keep_for(stream: torch.cuda.Stream, *tensors: torch.Tensor) -> None:
    """Keep device tensors made on another stream alive until `stream`'s work so far is done."""
    for t in tensors:
        if t.device.type == "cuda":
            t.record_stream(stream)


class CopyFence(Protocol):
    """The completion of a copy that host memory is read or written by (torch.cuda.Event's
    own method names, so a CUDA event is one)."""

    def query(self) -> bool: ...  # the copy has run: its host memory may be reused
    def synchronize(self) -> None: ...  # block the calling thread until it has


class HostFence:
    """The CPU implementation of CopyFence: done once set."""

    def __init__(self, done: bool = False) -> None:
        self._done = threading.Event()
        if done:
            self._done.set()

    def set(self) -> None:
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()


def fence_after_copy(device: torch.device) -> CopyFence:
    """A fence behind the copies enqueued so far on the calling thread's current stream
    (CUDA), or a done one (CPU: the copies have already run)."""
    if device.type != "cuda":
        return HostFence(done=True)
    event = torch.cuda.Event()
    event.record()
    return event


class KeptUntilDone:
    """Objects whose memory copies still read (a load's stored rows, leased DRAM blocks among
    them), kept referenced until the fence recorded after those copies is done. Thread-safe;
    `reap` drops what is done, oldest first (fences complete in stream order)."""

    def __init__(self) -> None:
        self._held: deque[tuple[CopyFence, object]] = deque()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, fence: CopyFence, what: object) -> None:
        if fence.query():
            return  # done already (every CPU copy): nothing to keep
        with self._lock:
            self._held.append((fence, what))

    def reap(self) -> None:
        with self._lock:
            while self._held and self._held[0][0].query():
                self._held.popleft()
