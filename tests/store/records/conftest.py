"""Fixtures of the record store tests: one record store of each kind, empty."""

from __future__ import annotations

import pytest

from chatstore.store.records.lmdb import LmdbRecordStore
from chatstore.store.records.redis import RedisRecordStore


@pytest.fixture(params=["lmdb", "redis"])
def records(request, tmp_path):
    """An LMDB record store under tmp_path, and one on the shared Redis, emptied."""
    if request.param == "lmdb":
        store = LmdbRecordStore(tmp_path / "records.lmdb")
    else:
        request.getfixturevalue("redis_client")  # emptied
        store = RedisRecordStore(request.getfixturevalue("redis_url"))
    yield store
    store.close()
