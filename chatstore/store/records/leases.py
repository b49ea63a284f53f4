"""A turn's lease on its session, so that replicas sharing one Redis run one turn at a time.

Each lease is a redis-py `Lock` (token-checked by its own scripts):

    acquire:  SET chatstore:lease:{<tenant>:<digest>} <token> NX PX <lease_ms>   (None if held)
    renew:    every lease/3, for every lease held: Lock.extend (PEXPIRE if still our token)
    release:  Lock.release (DEL if still our token: never another holder's lease)

One step is ours, not the Lock's: taking back a stale lease of this replica's own (a release
that never reached Redis during an outage), by the token's replica prefix (_TAKE_BACK).

The braces put the lease in the record's hash slot (Redis Cluster). A replica that dies stops
renewing and its leases expire after `session_lease_s`. A lease lost anyway (Redis hung past the
lease) is not a correctness hole: the turn's record write is a compare-and-set on the version it
read (records.append_turn), so the later writer gets RecordConflict instead of losing a turn.

With LMDB records there is one process: its busy set already serialises turns, and `LocalLeases`
hands out a lease that does nothing.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from typing import Protocol
from urllib.parse import quote

from redis.exceptions import LockError

from chatstore.store.record_keys import key_digest
from chatstore.store.records.base import RecordStore
from chatstore.store.records.record import SessionLease
from chatstore.store.records.redis import RedisRecordStore
from chatstore.store.session_kv import SessionKey

log = logging.getLogger(__name__)

LEASE_PREFIX = "chatstore:lease:"

_TAKE_BACK = """
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, string.len(ARGV[1])) == ARGV[1] then
    redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
    return 1
end
return 0
"""


def session_tag(key: SessionKey) -> str:
    """The session's Redis hash tag body: records and leases of a session share its slot."""
    return f"{quote(key.tenant, safe='')}:{key_digest(key)}"


def lease_name(key: SessionKey) -> str:
    return f"{LEASE_PREFIX}{{{session_tag(key)}}}"


class SessionLeases(Protocol):
    """What a turn (or a delete) takes on its session and gives back."""

    def acquire(self, key: SessionKey) -> SessionLease | None: ...

    def release(self, lease: SessionLease, wait: bool = True) -> None: ...

    def close(self) -> None: ...


class LocalLeases:
    """One process owns the records (LMDB): nothing to coordinate."""

    def acquire(self, key: SessionKey) -> SessionLease | None:
        return SessionLease(key)

    def release(self, lease: SessionLease, wait: bool = True) -> None:
        return None

    def close(self) -> None:
        return None


class RedisLeases:
    """Leases in the records' Redis, through their breaker and error mapping (503 when down)."""

    def __init__(self, records: RedisRecordStore, lease_s: float, replica_id: str = "") -> None:
        if lease_s <= 0:
            raise ValueError("session_lease_s must be positive")
        self.records = records
        self.lease_ms = max(1, int(lease_s * 1000))
        self.lease_s = self.lease_ms / 1000
        # Unique to this process (two servers in one process are two replicas): a token with
        # our prefix that no turn of ours holds is a stale lease of ours.
        self.replica = replica_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._take_back = records.client.register_script(_TAKE_BACK)
        self._held: dict[str, SessionLease] = {}  # lease name -> lease
        self._to_release: dict[str, SessionLease] = {}  # given back, not yet sent
        self._lock = threading.Lock()
        # Held while pending releases go out: an acquire of the same session waits for them
        # instead of finding our own lease still in Redis.
        self._sending = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self, key: SessionKey) -> SessionLease | None:
        """The session's lease, or None when another holder has it. Raises
        RecordStoreUnavailable when Redis is down."""
        name = lease_name(key)
        self._release_pending(name)  # our own last turn's release, not yet sent
        token = f"{self.replica}:{uuid.uuid4().hex[:12]}"
        call = self.records._call
        lock = self.records.client.lock(
            name,
            timeout=self.lease_s,
            blocking=False,
            thread_local=False,  # taken on a worker thread, renewed and released on others
            raise_on_release_error=False,  # a release after expiry: gone already, nothing to do
        )
        if not call(lock.acquire, token=token):
            # Held: by another replica, or by one of our own turns whose release did not
            # reach Redis (it was down then). A token of ours that no turn of ours holds is
            # stale: take it back. (Replica ids must be unique to the running process.)
            with self._lock:
                ours = name in self._held
            args = [f"{self.replica}:", token, self.lease_ms]
            if ours or not call(self._take_back, keys=[name], args=args):
                return None
            # The Lock keeps its token in `local` (thread_local=False: a plain namespace);
            # the token is what we just wrote, so extend and release check against it.
            lock.local.token = lock.redis.get_encoder().encode(token)
        lease = SessionLease(key, name, token, lock=lock)
        with self._lock:
            self._held[name] = lease
        self._start()
        return lease

    def release(self, lease: SessionLease, wait: bool = True) -> None:
        """Give the lease back. wait=False (the event loop) leaves the Redis call to the
        renewer thread; an acquire of the same session sends it first."""
        with self._lock:
            if self._held.get(lease.name) is not lease:
                return
            del self._held[lease.name]
            if not wait:
                self._to_release[lease.name] = lease
        if wait:
            self._send_release(lease)
        else:
            self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5)
        with self._lock:
            left = [*self._held.values(), *self._to_release.values()]
            self._held, self._to_release = {}, {}
        for lease in left:
            self._send_release(lease)

    # -- the renewer ------------------------------------------------------------------------

    def _start(self) -> None:
        with self._lock:
            if self._thread is not None or self._stop.is_set():
                return
            self._thread = threading.Thread(
                target=self._run, name="chatstore-lease-renewer", daemon=True
            )
        self._thread.start()

    def _run(self) -> None:
        interval = self.lease_ms / 3000
        while not self._stop.is_set():
            self._wake.wait(interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            self._release_pending(None)
            self._renew_all()

    def _renew_all(self) -> None:
        with self._lock:
            held = list(self._held.values())
        for lease in held:
            try:
                self.records._call(lease.lock.extend, self.lease_s, replace_ttl=True)
            except LockError:  # another token or none (expired), or already released: not ours
                if not lease.lost:
                    lease.lost = True
                    log.warning("lease %s expired while its turn ran", lease.name)
            except Exception as exc:  # Redis down: retried next round, the thread lives on
                log.warning("renewing the lease of %s failed: %s", lease.name, exc)

    def _release_pending(self, name: str | None) -> None:
        """Send the pending releases (all, or the one of lease `name`)."""
        with self._sending:
            with self._lock:
                if name is None:
                    due, self._to_release = list(self._to_release.values()), {}
                else:
                    one = self._to_release.pop(name, None)
                    due = [one] if one is not None else []
            for lease in due:
                self._send_release(lease)

    def _send_release(self, lease: SessionLease) -> None:
        try:
            self.records._call(lease.lock.release)
        except Exception as exc:  # it expires by itself
            log.warning("releasing the lease of %s failed: %s", lease.name, exc)


def session_leases(
    records: RecordStore, lease_s: float = 30.0, replica_id: str = ""
) -> SessionLeases:
    """Leases for the records' backend: in Redis when the records are, else local no-ops."""
    if isinstance(records, RedisRecordStore):
        return RedisLeases(records, lease_s, replica_id)
    return LocalLeases()
