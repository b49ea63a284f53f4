"""The store's copy of each session's retention (the records hold it): read by placement and by
the expiry checks, which run without reading records."""

from __future__ import annotations

from chatstore.store.retention import DEFAULT, Retention
from chatstore.store.session_kv import SessionKey


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
