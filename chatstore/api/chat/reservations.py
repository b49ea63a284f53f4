"""Which sessions have a turn (or a delete) running in this process, the turns in flight per
tenant, and the sessions' leases shared with other replicas (one Redis).

A session has at most one turn in flight (409 `session_busy` otherwise); a tenant at most
`turns_per_tenant` (429 `tenant_busy`). The local check comes first and settles turns within
this process without a round trip; the lease then settles them across replicas (409
`session_busy` while another replica holds it).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from chatstore.api.common.errors import APIError, store_error
from chatstore.api.common.settings import ServerSettings
from chatstore.store.ports import RecordStoreError, SessionKVAdmin, SessionLease

SessionRef = tuple[str, str]  # (tenant, session id)


def busy_error(sid: str) -> APIError:
    return APIError(409, f"session {sid} has a turn in progress", code="session_busy")


class SessionReservations:
    def __init__(self, store: SessionKVAdmin) -> None:
        self.store = store
        self._busy: set[SessionRef] = set()  # sessions with a turn (or a delete) running
        self._leases: dict[SessionRef, SessionLease] = {}  # their leases (shared with replicas)
        self._turns: Counter[str] = Counter()  # turns in flight per tenant
        self._lock = threading.Lock()  # turns open in worker threads

    def is_busy(self, key: SessionRef) -> bool:
        with self._lock:
            return key in self._busy

    def turns_in_flight(self, tenant: str) -> int:
        with self._lock:
            return self._turns[tenant]

    def reserve_turn(self, key: SessionRef, settings: ServerSettings) -> None:
        """The session for one turn, here and (its lease) across replicas; APIError when it
        or its tenant is busy (settings: the service's now, they may change while it runs)."""
        tenant = key[0]
        with self._lock:
            if key in self._busy:
                raise busy_error(key[1])
            limit = settings.turns_per_tenant
            if limit is not None and self._turns[tenant] >= limit:
                raise APIError(
                    429,
                    f"tenant has {limit} turns in flight (max_turns_per_tenant)",
                    code="tenant_busy",
                    headers={"Retry-After": str(settings.retry_after_s)},
                )
            self._busy.add(key)
            self._turns[tenant] += 1
        try:
            lease = self._lease(key)
        except BaseException:
            self.release_turn(key)
            raise
        with self._lock:
            self._leases[key] = lease

    def release_turn(self, key: SessionRef) -> None:
        """Free the session here; its lease goes back in the background (this may run on the
        event loop, which must not wait on Redis)."""
        with self._lock:
            lease = self._leases.pop(key, None)
            if key in self._busy:
                self._busy.discard(key)
                self._turns[key[0]] -= 1
                if self._turns[key[0]] <= 0:
                    del self._turns[key[0]]
        if lease is not None:
            self.store.release_lease(lease, wait=False)

    def take_lease(self, key: SessionRef) -> SessionLease | None:
        """The session's lease, handed to the turn's append (which gives it back)."""
        with self._lock:
            return self._leases.pop(key, None)

    def release_lease(self, key: SessionRef) -> None:
        """Give the lease back now (a worker thread), before the turn is acknowledged: the
        client's next turn may go to another replica."""
        with self._lock:
            lease = self._leases.pop(key, None)
        if lease is not None:
            self.store.release_lease(lease)

    @contextmanager
    def deleting(self, key: SessionRef) -> Iterator[None]:
        """The session held busy and leased while it is deleted: no turn opens in between."""
        with self._lock:
            if key in self._busy:
                raise busy_error(key[1])
            self._busy.add(key)
        try:
            lease = self._lease(key)
            try:
                yield
            finally:
                self.store.release_lease(lease)
        finally:
            with self._lock:
                self._busy.discard(key)

    def _lease(self, key: SessionRef) -> SessionLease:
        try:
            lease = self.store.acquire_lease(*key)
        except RecordStoreError as exc:
            raise store_error(exc) from None
        if lease is None:
            raise APIError(
                409,
                f"session {key[1]}: a turn is in progress on another replica",
                code="session_busy",
            )
        return lease
