"""Replicas drop a data key another replica shredded or replaced, through the key store's epoch.

Every change to the shared key store (a shred, a rewrap, a data-key rotation) raises its epoch
(key_store_redis.py). A thread of each replica reads the epoch once a second (never on a read
path: the engine thread opens values); when it moved, that thread reads the cached tenants'
keys again (Keyring.refresh), and any cache entry still older than the epoch is checked
against the store on its next use: a shredded tenant's key is gone there, so its values stop
opening on every replica within about a second of the shred.
Meanwhile the shredding replica is purging them. A Redis outage leaves each replica with the
keys it has; the shred itself needs the key store, so it fails (keyring.ShredFailed) while
Redis is out.
"""

from __future__ import annotations

import logging
import threading

from chatstore.store.sealing.keyring import Keyring

log = logging.getLogger(__name__)


class KeyWatch:
    def __init__(self, keyring: Keyring, interval_s: float = 1.0) -> None:
        self.keyring = keyring
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="chatstore-key-watch", daemon=True)
        self._thread.start()

    def poll(self) -> int:
        """Read the store's epoch once; when it moved, the keyring reads its cached tenants'
        keys again here, off the read paths. The epoch seen."""
        try:
            epoch = self.keyring.store.epoch()
            changed = self.keyring.refresh(epoch) if epoch > self.keyring.seen_epoch else []
            if changed:
                log.info("data keys changed on another replica: %s", changed)
        except Exception as exc:  # an outage: keep the keys we have, look again later
            log.debug("key store unreadable (%s)", exc)
        return self.keyring.seen_epoch

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
