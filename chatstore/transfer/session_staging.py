"""Which sessions the read buffer stages, and when (CachedAttention §3.2.1, Fig. 6(c)):

    a client's hint (typing, POST .../prefetch)   `stage(tenant, session)` at once
    each scheduled step (`look_ahead`)             the sessions of the first STAGE_AHEAD requests
                                                   of the engine's waiting queue that have not
                                                   started and that the connector has not admitted

The waiting queue is the `QueueLookahead` of chatstore/store/ports.py, the one placement's
look-ahead reads: the scheduler exposes who runs next once, and both consume it. Staging itself
(the lookup, the layers) runs on the loader's threads; the engine thread only queues it.
"""

from __future__ import annotations

from collections.abc import Container

from chatstore.store.ports import KVSource, QueueLookahead, WaitingSession
from chatstore.store.session_kv import SessionKey
from chatstore.transfer.layer_loader import LayerLoader
from chatstore.transfer.read_buffer import ReadBuffer

STAGE_AHEAD = 4  # queued requests whose sessions the read buffer stages each step


def sessions_to_stage(queue: QueueLookahead, n: int = STAGE_AHEAD) -> list[WaitingSession]:
    """The first n queued requests that have not started (none of their KV is computed),
    soonest first: the ones a read buffer stages."""
    return [entry for entry in queue.waiting_sessions(n) if not entry.started]


class SessionStaging:
    def __init__(
        self, store: KVSource, buffer: ReadBuffer, loader: LayerLoader, stage_queued: bool
    ) -> None:
        self.store = store
        self.buffer = buffer
        self.loader = loader
        self.stage_queued = stage_queued  # False: hinted sessions only
        self.queue: QueueLookahead | None = None

    def set_waiting_queue(self, queue: QueueLookahead) -> None:
        self.queue = queue

    def stage(self, tenant: str, session_id: str) -> bool:
        """Look the session up and stage its first layers on the loader thread (a hint that it
        runs soon); False when the read buffer is off or holds it already."""
        key = SessionKey(tenant, session_id)
        entry = self.buffer.want(key, self.store.version(tenant, session_id))
        if entry is None:
            return False
        self.loader.stage(entry)
        return True

    def stage_queued_sessions(self, admitted: Container[str]) -> None:
        """Stage the sessions queued next, but for requests in `admitted` (the connector looked
        them up already: a preempted one, or a head that waits for blocks)."""
        if not (self.buffer.enabled and self.stage_queued) or self.queue is None:
            return
        for entry in sessions_to_stage(self.queue):
            if entry.session_id is not None and entry.request_id not in admitted:
                self.stage(entry.tenant, entry.session_id)
