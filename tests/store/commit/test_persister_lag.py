"""Write-back's lag is bounded under sustained load (issue 37, item 5): with the engine never
idle (a prefill always running), chunks still reach the slow tier by their deadline instead of
each waiting for an idle moment that never comes."""

from __future__ import annotations

import threading
import time

from chatstore.store.commit.persister import Persister
from chatstore.store.session_kv import ChunkKey

# A liveness bound, far above the lag and far below what per-chunk deferral took before
# (10 chunks x max_defer_s 0.5 s, after the lag).
BOUND_S = 3.0


def test_chunks_land_by_their_deadline_when_the_engine_is_never_idle():
    landed: dict[ChunkKey, float] = {}
    lock = threading.Lock()

    def persist(key: ChunkKey) -> bool:
        with lock:
            landed[key] = time.monotonic()
        return True

    persister = Persister(persist, lag_s=0.3)
    persister.idle = threading.Event()  # never set: a prefill is always running
    keys = [ChunkKey("t", f"{i:032x}") for i in range(10)]
    added = {}
    for key in keys:
        added[key] = time.monotonic()
        persister.add(key)
    deadline = time.monotonic() + 10 * BOUND_S
    while len(landed) < len(keys) and time.monotonic() < deadline:
        time.sleep(0.02)
    persister.close(flush=False)
    assert set(landed) == set(keys)
    late = {k.digest[-2:]: round(landed[k] - added[k], 2) for k in keys}
    assert max(late.values()) <= BOUND_S, late
    # Not before it was due either: the batch of a turn's chunks still forms (lag / 2).
    assert min(late.values()) >= 0.3 / 2 - 0.01, late


def test_a_chunk_waits_for_an_idle_moment_until_its_deadline():
    landed: list[float] = []
    persister = Persister(lambda key: landed.append(time.monotonic()) or True, lag_s=2.0)
    idle = persister.idle = threading.Event()
    started = time.monotonic()
    persister.add(ChunkKey("t", "0" * 32))
    time.sleep(1.3)  # due at 1.0 s; the prefill keeps running: deferred (max_defer_s 0.5)
    assert not landed
    idle.set()  # the prefill ends: the copy goes at once
    end = time.monotonic() + 10.0
    while not landed and time.monotonic() < end:
        time.sleep(0.01)
    persister.close(flush=False)
    assert landed and landed[0] - started >= 1.0
