"""Physical pages behind the slots: committed ahead of the forward, kept for reuse, trimmed.

Each slot s owns, in every one of the 2L per-layer K/V buffers, the page-aligned byte range

    buffer b = 2 * layer + (0 K | 1 V):   [b * N * Bb + s * M * Bb,  ... + M * Bb)

(N blocks in all, M blocks a slot, Bb bytes a block). `committed[s]` is how many leading bytes of
that range are resident in every buffer (a page multiple): tokens [0, t) need
ceil(t * token_bytes / page) pages a buffer, so a live slot holds less than one page a buffer more
than the KV it uses.

    ensure(slot, t)    synchronous, before the forward writes; the time spent (including waiting
                       for the background thread) is the "alloc wait" the forward saw
    prefetch(targets)  the next step's pages, committed by a background thread during this step
    release(slot)      a finished request's slot keeps its pages (deferred reclamation) while the
                       idle slots hold at most `watermark_bytes`; beyond it the highest idle
                       slots are given back with MADV_DONTNEED (low slots are reused first)
    trim()             give back every idle slot's pages
"""

from __future__ import annotations

import queue
import threading
import time

from chatstore.engine.vattention.virtual_memory import VirtualRegion


class PageCommitter:
    def __init__(
        self,
        region: VirtualRegion,
        num_buffers: int,
        buffer_stride: int,
        slot_bytes: int,
        token_bytes: int,
        num_slots: int,
        watermark_bytes: int,
    ) -> None:
        self.region = region
        self.page = region.page_size
        self.num_buffers = num_buffers
        self.buffer_stride = buffer_stride  # bytes from one layer's K (or V) buffer to the next
        self.slot_bytes = slot_bytes  # bytes of one slot in one buffer (a page multiple)
        self.token_bytes = token_bytes
        self.watermark_bytes = watermark_bytes
        self.committed = [0] * num_slots
        self._live = [False] * num_slots
        self._generation = [0] * num_slots
        self._lock = threading.Lock()
        self.wait_s = 0.0  # time `ensure` spent committing or waiting: the forward's alloc wait
        self.sync_commits = 0  # ensure calls that found pages missing
        self.background_commits = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="vattention-commit", daemon=True)
        self._thread.start()

    # -- the engine thread -------------------------------------------------------------------
    def acquire(self, slot: int) -> None:
        with self._lock:
            self._live[slot] = True
            self._generation[slot] += 1

    def release(self, slot: int) -> None:
        with self._lock:
            self._live[slot] = False
            self._generation[slot] += 1
            self._reclaim(self.watermark_bytes)

    def ensure(self, slot: int, tokens: int) -> None:
        need = self._bytes_for(tokens)
        if need <= self.committed[slot]:  # a racy read, but committed only grows while live
            return
        start = time.perf_counter()
        with self._lock:
            self._grow(slot, need)
        self.sync_commits += 1
        self.wait_s += time.perf_counter() - start

    def prefetch(self, targets: list[tuple[int, int]]) -> None:
        """Commit (slot, tokens) pairs in the background; skipped if the slot changed hands."""
        todo = [
            (slot, self._bytes_for(tokens), self._generation[slot])
            for slot, tokens in targets
            if self._bytes_for(tokens) > self.committed[slot]
        ]
        if todo:
            self._queue.put(todo)

    def drain(self) -> None:
        """Wait until the background thread has done everything queued so far."""
        done = threading.Event()
        self._queue.put(done)
        done.wait()

    def trim(self) -> None:
        with self._lock:
            self._reclaim(0)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    # -- accounting ----------------------------------------------------------------------------
    def committed_bytes(self, live: bool | None = None) -> int:
        """Committed bytes over all buffers: of live slots, idle slots, or all (None)."""
        return self.num_buffers * sum(
            c for c, lv in zip(self.committed, self._live, strict=True) if live in (None, lv)
        )

    # -- internals -----------------------------------------------------------------------------
    def _bytes_for(self, tokens: int) -> int:
        return min(-(-tokens * self.token_bytes // self.page) * self.page, self.slot_bytes)

    def _grow(self, slot: int, need: int) -> None:
        have = self.committed[slot]
        if need <= have:
            return
        base = slot * self.slot_bytes + have
        for b in range(self.num_buffers):
            self.region.commit(b * self.buffer_stride + base, need - have)
        self.committed[slot] = need

    def _reclaim(self, limit: int) -> None:
        idle = [s for s, c in enumerate(self.committed) if c and not self._live[s]]
        held = self.num_buffers * sum(self.committed[s] for s in idle)
        for slot in reversed(idle):
            if held <= limit:
                return
            held -= self.num_buffers * self.committed[slot]
            for b in range(self.num_buffers):
                self.region.release(
                    b * self.buffer_stride + slot * self.slot_bytes, self.committed[slot]
                )
            self.committed[slot] = 0

    def _run(self) -> None:
        while (todo := self._queue.get()) is not None:
            if isinstance(todo, threading.Event):
                todo.set()
                continue
            for slot, need, generation in todo:
                with self._lock:
                    current = self._live[slot] and self._generation[slot] == generation
                    if current and need > self.committed[slot]:
                        self._grow(slot, need)
                        self.background_commits += 1
