"""The store's copy of each session's retention (the records hold it): read by placement and by
the expiry checks, which run without reading records."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from chatstore.store.retention import DEFAULT, Retention
from chatstore.store.session_kv import SessionKey

if TYPE_CHECKING:
    from chatstore.store.placement.session_placement import SessionPlacement
    from chatstore.store.records.record import SessionRecord


class RetentionTable:
    """session -> Retention, holding only sessions that differ from the default."""

    def __init__(self) -> None:
        self._of: dict[SessionKey, Retention] = {}

    def get(self, key: SessionKey) -> Retention:
        return self._of.get(key, DEFAULT)

    def set(self, key: SessionKey, retention: Retention) -> None:
        if retention == DEFAULT:
            self._of.pop(key, None)
        else:
            self._of[key] = retention

    def drop(self, key: SessionKey) -> None:
        self._of.pop(key, None)


class SessionRetention:
    """The table kept in step with the records and told to placement (under the store's lock:
    placement takes the tiers' lock after it)."""

    def __init__(
        self, table: RetentionTable, placement: SessionPlacement, lock: threading.RLock
    ) -> None:
        self.table, self.placement, self.lock = table, placement, lock

    def set(self, key: SessionKey, retention: Retention) -> None:
        with self.lock:
            self.table.set(key, retention)
            self.placement.tell("set_priority", key, retention.priority)

    def retain(self, record: SessionRecord) -> None:
        """A record read (at start, or another replica's): its retention, if it changed."""
        retention = Retention(record.priority, record.ttl_s)
        if retention != self.table.get(record.key):
            self.set(record.key, retention)
