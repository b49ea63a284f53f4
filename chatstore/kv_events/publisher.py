"""ZMQ publisher of KV-event batches with vLLM's framing and replay protocol.

    PUB     [topic, seq: 8-byte big-endian, payload]         one batch per interval with events
    ROUTER  request  [identity, b"", start_seq: 8 bytes big-endian]
            replies  [identity, b"", seq, payload] for each buffered seq >= start_seq,
                     then [identity, b"", (-1).to_bytes(8, "big", signed=True), b""]

Producers (the engine thread, store threads) only append to a queue; one thread owns both
sockets, so neither ever waits on ZMQ. As in vLLM, an endpoint with a wildcard (`*`, `::`) or
an ipc/inproc one is bound, any other is connected to (the subscriber binds); the replay
endpoint is always bound.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import zmq

from chatstore.kv_events.wire import KVEvent, encode_batch

log = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        interval_s: float = 0.01,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int = 0,
    ) -> None:
        self.topic = topic.encode()
        self.interval_s = interval_s
        self.data_parallel_rank = data_parallel_rank
        self._queue: queue.SimpleQueue[KVEvent | None] = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._ctx: zmq.Context = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay: zmq.Socket | None = None
        try:
            if _binds(endpoint):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def put(self, event: KVEvent) -> None:
        """Never blocks (an unbounded queue: events are small and drained every interval)."""
        if not self._closed:
            self._queue.put(event)

    def close(self, timeout: float = 2.0) -> None:
        """Publish what is queued, then stop and close the sockets."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)

    @property
    def next_seq(self) -> int:
        return self._next_seq

    # -- the publisher thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            running = True
            while running:
                self._serve_replays(self.interval_s)
                events, running = self._drain()
                if events:
                    self._send(events)
        except Exception:
            log.exception("the KV event publisher stopped")
        finally:
            self._close_sockets()

    def _drain(self) -> tuple[list[KVEvent], bool]:
        events: list[KVEvent] = []
        while True:
            try:
                event = self._queue.get_nowait()
            except queue.Empty:
                return events, True
            if event is None:
                return events, False
            events.append(event)

    def _send(self, events: list[KVEvent]) -> None:
        seq = self._next_seq
        payload = encode_batch(time.time(), events, self.data_parallel_rank)
        self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self._next_seq = seq + 1

    def _serve_replays(self, wait_s: float) -> None:
        """Wait up to wait_s for replay requests (or just sleep without a replay socket)."""
        if self._replay is None:
            time.sleep(wait_s)
            return
        timeout_ms = int(wait_s * 1000)
        while self._replay.poll(timeout_ms):
            self._serve_replay(self._replay.recv_multipart())
            timeout_ms = 0

    def _serve_replay(self, frames: list[bytes]) -> None:
        assert self._replay is not None
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            log.warning("ignored a malformed KV event replay request (%d frames)", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=500)  # a moment for the last batches to leave
        if self._replay is not None:
            self._replay.close(linger=0)


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
