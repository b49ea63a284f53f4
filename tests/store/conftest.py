"""Fixtures of the store tests in more than one folder: the two Redis servers of replicas in
process (tests/support/replicas.py's Replica), one the shared KV tier, one the records'."""

from __future__ import annotations

import pytest

from tests.support.redis_server import redis_server_binary, start_local_redis


@pytest.fixture
def kv_redis(request):
    """The shared KV Redis: allkeys-lru (deploy/'s policy), at the test module's KV_MAXMEMORY
    bytes when it sets one (else no limit)."""
    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed")
    server = start_local_redis(maxmemory=getattr(request.module, "KV_MAXMEMORY", 0))
    yield server
    server.stop()


@pytest.fixture
def records_redis():
    """The session records' Redis: noeviction (deploy/redis-records.conf)."""
    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed")
    server = start_local_redis(policy="noeviction")
    yield server
    server.stop()
