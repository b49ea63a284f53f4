"""The scheduler's waiting queue: preempted sequences first, then new requests round-robin by
tenant, first come first served within a tenant.

    resumed   [p1 p2]                          preempted, oldest start first; before anything new
    tenants   A: [a1 a2 a3]   B: [b1]          rotation A -> B
    order     p1 p2 a1 b1 a2 a3                a tenant goes to the back once its head is taken

One tenant's long queue delays another tenant's next request by at most one request per tenant
ahead of it in the rotation, and no tenant may hold more than `tenant_queue_limit` of the
`max_waiting` slots. The order is a pure function of the queue, so `snapshot()` (the store's
look-ahead, the read buffer's staging) sees requests in the order admission takes them.

Thread-safety: the API thread pushes (to its tenant's tail, or a new tenant at the back of the
rotation); only the model thread takes the head or removes. So a head seen by `peek()` is still
the head when the model thread `pop`s it.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Iterator

from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.request import EngineOverloadedError
from chatstore.engine.sequence import Sequence


class WaitingQueue:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._resumed: deque[Sequence] = deque()
        self._tenants: dict[str, deque[Sequence]] = {}  # insertion order = rotation order
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def push(self, seq: Sequence) -> None:
        """Queue a new request (any thread); raises EngineOverloadedError when the queue, or
        the tenant's share of it, is full."""
        tenant = seq.request.tenant
        with self._lock:
            self._check_room(tenant)
            self._tenants.setdefault(tenant, deque()).append(seq)
            self._size += 1

    def push_front(self, seq: Sequence) -> None:
        """A preempted sequence: ahead of every new request (the model thread)."""
        with self._lock:
            self._resumed.appendleft(seq)
            self._size += 1

    def peek(self) -> Sequence | None:
        with self._lock:
            if self._resumed:
                return self._resumed[0]
            return next((q[0] for q in self._tenants.values()), None)

    def pop(self, seq: Sequence) -> None:
        """Take `seq`, the head (model thread); its tenant goes to the back of the rotation."""
        with self._lock:
            if self._resumed and self._resumed[0] is seq:
                self._resumed.popleft()
            else:
                tenant = seq.request.tenant
                queue = self._tenants.pop(tenant)
                assert queue[0] is seq, "only the head of the queue is admitted"
                queue.popleft()
                if queue:
                    self._tenants[tenant] = queue
            self._size -= 1

    def remove(self, seq: Sequence) -> bool:
        """Take `seq` out wherever it waits (model thread); False when it is not queued."""
        with self._lock:
            if seq in self._resumed:
                self._resumed.remove(seq)
            else:
                queue = self._tenants.get(seq.request.tenant)
                if queue is None or seq not in queue:
                    return False
                queue.remove(seq)
                if not queue:
                    del self._tenants[seq.request.tenant]
            self._size -= 1
            return True

    def snapshot(self, n: int | None = None) -> list[Sequence]:
        """The first n queued sequences (all when None), in the order admission takes them."""
        with self._lock:
            return list(itertools.islice(self._order(), n))

    def _order(self) -> Iterator[Sequence]:
        yield from self._resumed
        for round_ in itertools.zip_longest(*self._tenants.values()):
            yield from (seq for seq in round_ if seq is not None)

    def _check_room(self, tenant: str) -> None:
        max_waiting = self.config.max_waiting
        if self._size >= max_waiting:
            raise EngineOverloadedError(
                f"engine overloaded: {self._size} requests waiting (max_waiting={max_waiting})"
            )
        held = len(self._tenants.get(tenant, ())) + sum(
            1 for s in self._resumed if s.request.tenant == tenant
        )
        limit = self.config.tenant_queue_limit
        if held >= limit:
            raise EngineOverloadedError(
                f"engine overloaded: tenant {tenant!r} has {held} requests waiting (tenant "
                f"limit {limit}: tenant_queue_share={self.config.tenant_queue_share} of "
                f"max_waiting={max_waiting})"
            )
