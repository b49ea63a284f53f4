"""FIFO baseline: evict the session that entered the store first. Blind to the queue."""

from __future__ import annotations

from collections.abc import Hashable

from chatstore.store.placement.policies.lru import LRUPolicy


class FIFOPolicy(LRUPolicy):
    """First in, first out: the stamp is set when a session first enters the store and is kept
    while it stays there (a turn's re-save, a demotion or a promotion do not renew it); a session
    that was dropped and comes back counts as new.
    """

    name = "fifo"

    def on_access(self, session: Hashable) -> None:
        """Use does not reorder FIFO; a session's first use stamps it."""
        self._stamp(session)
