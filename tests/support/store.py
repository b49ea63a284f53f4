"""Test helpers that put the store in a state only pressure would bring about."""

from __future__ import annotations

from chatstore.store import AttentionStore
from chatstore.store.session_kv import SessionKey


def push_down(store: AttentionStore, tenant: str, session_id: str) -> None:
    """The session's chunks leave DRAM as an eviction would leave them: on SSD only."""
    store.wait_saved(tenant, session_id)
    chain = store.index.get(SessionKey(tenant, session_id))
    assert chain is not None, f"{tenant}/{session_id} holds no chunks"
    for chunk in chain.chunks:
        assert store.tiers.persist(chunk), f"chunk {chunk} did not reach SSD"
        with store.tiers.lock:
            store.tier("dram").delete(chunk)
