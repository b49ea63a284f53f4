"""The staging ring's bookkeeping through copy_events' CPU fences (HostFence): a slot is reused
only once the fence of its copy is done, space comes back from the oldest slot on, requests wrap
to the start, and what can never fit is refused at once. Real buffers and real copies; a fence
left unset stands for a CUDA copy still running (on a GPU it is the event recorded after it)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from chatstore.transfer.copy_events import HostFence, KeptUntilDone, fence_after_copy
from chatstore.transfer.pinned_staging import ALIGN, StagingRing

CPU = torch.device("cpu")


def ring(capacity: int = 4 * ALIGN) -> StagingRing:
    return StagingRing(capacity, pin=False)


def test_slots_are_handed_out_in_order_at_aligned_offsets() -> None:
    r = ring()
    a, b = r.acquire(10), r.acquire(ALIGN + 1)
    assert a is not None and b is not None
    assert (a.start, a.end) == (0, ALIGN) and (b.start, b.end) == (ALIGN, 3 * ALIGN)
    assert r.in_use() == 2 and not r.pinned


def test_a_slot_is_reused_only_once_its_fence_is_done() -> None:
    r = ring(2 * ALIGN)
    a = r.acquire(ALIGN)
    assert a is not None
    a.data.fill_(7)
    running = HostFence()
    r.retire(a, running)
    b = r.acquire(ALIGN)
    assert b is not None and b.start == ALIGN  # a's bytes are still being copied
    assert r.acquire(ALIGN) is None  # engine thread: no waiting, no room
    assert int(a.data[0]) == 7
    running.set()
    c = r.acquire(ALIGN)
    assert c is not None and c.start == 0  # wrapped onto a's bytes, now free


def test_space_comes_back_from_the_oldest_slot_only() -> None:
    r = ring(3 * ALIGN)
    a, b, c = (r.acquire(ALIGN) for _ in range(3))
    assert a is not None and b is not None and c is not None
    r.retire(b, fence_after_copy(CPU))  # done, but behind a
    r.retire(c, fence_after_copy(CPU))
    assert r.acquire(ALIGN) is None and r.in_use() == 3
    r.release(a)
    assert r.in_use() == 0
    d = r.acquire(3 * ALIGN)
    assert d is not None and d.start == 0


def test_wrapping_skips_the_tail_that_is_too_short() -> None:
    r = ring(4 * ALIGN)
    a, b, c = r.acquire(ALIGN), r.acquire(ALIGN), r.acquire(ALIGN)
    assert a is not None and b is not None and c is not None
    r.release(a)
    r.release(b)
    d = r.acquire(2 * ALIGN)  # the end holds one ALIGN only: d goes to the start
    assert d is not None and (d.start, d.end) == (0, 2 * ALIGN)
    # Wrapped: the head is d's end and c is next to free; the byte range after c waits until
    # c is free (a ring reuses space in order, never out of it).
    assert r.acquire(1) is None
    r.release(c)
    e = r.acquire(2 * ALIGN)
    assert e is not None and (e.start, e.end) == (2 * ALIGN, 4 * ALIGN)


def test_a_request_larger_than_the_ring_falls_back_at_once() -> None:
    r = ring(2 * ALIGN)
    assert r.acquire(2 * ALIGN + 1, block=True) is None  # would never fit: no waiting
    assert r.refused == 1 and r.in_use() == 0
    assert r.acquire(2 * ALIGN) is not None


def test_a_blocking_acquire_waits_for_the_oldest_fence() -> None:
    r = ring(2 * ALIGN)
    a = r.acquire(2 * ALIGN)
    assert a is not None
    running = HostFence()
    r.retire(a, running)
    got = []

    def copier() -> None:
        got.append(r.acquire(ALIGN, block=True))

    thread = threading.Thread(target=copier)
    thread.start()
    time.sleep(0.05)
    assert not got  # still waiting for a's copy
    running.set()
    thread.join(5)
    assert got and got[0] is not None and got[0].start == 0


def test_a_blocking_acquire_waits_for_a_slot_not_yet_retired() -> None:
    r = ring(ALIGN)
    a = r.acquire(ALIGN)
    assert a is not None
    got = []
    thread = threading.Thread(target=lambda: got.append(r.acquire(ALIGN, block=True)))
    thread.start()
    time.sleep(0.05)
    assert not got
    r.retire(a, fence_after_copy(CPU))
    thread.join(5)
    assert got and got[0] is not None


def test_slot_views_are_typed_and_share_the_ring() -> None:
    r = ring()
    slot = r.acquire(6 * 4)
    assert slot is not None
    t = slot.view((2, 3), torch.float32)
    t.copy_(torch.arange(6.0).view(2, 3))
    assert t.is_contiguous() and torch.equal(slot.data[:24].view(torch.float32), torch.arange(6.0))
    with pytest.raises(ValueError):
        StagingRing(0)


def test_kept_objects_go_when_their_fence_is_done_in_order() -> None:
    kept = KeptUntilDone()
    first, second = HostFence(), HostFence()
    kept.hold(first, "rows 1")
    kept.hold(second, "rows 2")
    kept.hold(fence_after_copy(CPU), "done already")  # a CPU copy: never held
    assert len(kept) == 2
    second.set()
    kept.reap()
    assert len(kept) == 2  # behind `first`
    first.set()
    kept.reap()
    assert len(kept) == 0
