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
caching allocator does not hand its memory out before the copy stream is done with it.
"""

from __future__ import annotations

import threading
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
