"""Replicas share the shred list through Redis, as they share the secret.

    chatstore:shred   hash: tenant -> generation (only ever raised)

A replica that crypto-shreds a tenant raises the tenant's generation here (a Lua max, atomic)
as well as in its own shredded.json; every replica reads the hash at start and then once a
second on a thread of its own (never on a read path: the engine thread derives keys), and adopts
any higher generation. For at most that second another replica may still open the tenant's
values with the old key: they are being purged at the same moment, and the key is gone for
good as soon as every replica has caught up. A Redis outage leaves each replica with the
generations it last saw.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from chatstore.store.sealing.keyring import Keyring

log = logging.getLogger(__name__)

HASH = "chatstore:shred"
# Raise the tenant's generation to at least ARGV[2]; the generation it has now.
_RAISE = """
local now = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
local want = tonumber(ARGV[2])
if want > now then
  redis.call('HSET', KEYS[1], ARGV[1], want)
  return want
end
return now
"""


class ShredNotShared(RuntimeError):
    """The shred stands on this replica (its key is gone here) but Redis did not take it, so
    the other replicas may still derive the old key: retry once Redis is back."""


class SharedShreds:
    def __init__(self, client: Any, keyring: Keyring, interval_s: float = 1.0) -> None:
        self.client = client
        self.keyring = keyring
        self.interval_s = interval_s
        self._raise = client.register_script(_RAISE)
        self._stop = threading.Event()
        self.pull()
        keyring.shared = self
        self._thread = threading.Thread(target=self._loop, name="chatstore-shreds", daemon=True)
        self._thread.start()

    def pull(self) -> list[str]:
        """Adopt the generations other replicas reached; the tenants whose key changed."""
        try:
            raw = self.client.hgetall(HASH)
        except Exception as exc:  # an outage: keep what we have, try again later
            log.debug("shred list: Redis unreachable (%s)", exc)
            return []
        seen = {_text(t): int(g) for t, g in raw.items()}
        return self.keyring.merge_generations(seen)

    def publish(self, tenant: str, generation: int) -> int:
        """Raise tenant's shared generation to at least `generation`; the one it has now.
        ShredNotShared when Redis does not take it."""
        try:
            return int(self._raise(keys=[HASH], args=[tenant, generation]))
        except Exception as exc:
            raise ShredNotShared(
                f"tenant {tenant!r} was shredded on this replica, but the shared shred list in "
                f"Redis could not be updated ({exc}): retry"
            ) from exc

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            if changed := self.pull():
                log.warning("tenants crypto-shredded on another replica: %s", changed)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
