"""Redis over TLS with an ACL user (issue 26, item 3), against real redis-servers that speak TLS
only, require client certificates and load deploy/redis-users.acl.template: a session's KV and
record round-trip through them (a single server and a one-node Redis Cluster), the ACL user may
touch `chatstore:*` keys only and Redis refuses none of the commands the store sends, and a
client trusting another CA refuses to connect while the store keeps serving from its local
tiers (the failed handshake is an outage to the breaker)."""

from __future__ import annotations

import time

import httpx
import pytest
import redis as redis_lib

from chatstore.config import load_config
from chatstore.redis_security import RedisSecurity
from chatstore.server.launcher import local_server
from chatstore.store.attention_store import AttentionStore
from chatstore.store.records.leases import session_leases
from chatstore.store.session_kv import ChunkKey
from chatstore.store.settings import StoreSettings
from chatstore.store.tiers.base import TierUnavailable
from chatstore.store.tiers.breaker import CircuitBreaker
from chatstore.store.tiers.redis import RedisTier, connect_redis
from tests.support.redis_server import redis_server_binary
from tests.support.redis_tls import TLSRedis, make_tls_files, start_tls_redis
from tests.support.store import TINY_SPEC, TOKEN_BYTES, lookup, saved_tokens, value

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(redis_server_binary() is None, reason="redis-server is not installed"),
]


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    return make_tls_files(tmp_path_factory.mktemp("redis-tls"))


@pytest.fixture(scope="module")
def tls_server(tls_files):
    server = start_tls_redis(tls_files)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tls_cluster(tls_files):
    server = start_tls_redis(tls_files, cluster=True)
    yield server
    server.stop()


@pytest.fixture
def admin(tls_server):
    """The ACL's admin user: Redis emptied and its ACL LOG cleared before the test."""
    client = tls_server.admin_client()
    client.flushall()
    client.acl_log_reset()
    yield client
    client.close()


def remote_store(tmp_path, server: TLSRedis, url: str | None = None, **kw) -> AttentionStore:
    """A store whose KV and records live in the TLS Redis only (no DRAM or LMDB copy), reached
    as the ACL user `chatstore`."""
    settings = StoreSettings(
        data_dir=tmp_path,
        dram_bytes=kw.pop("dram_bytes", 0),
        ssd_bytes=kw.pop("ssd_bytes", 0),
        redis_url=url or server.url,
        redis_bytes=1 << 20,
        redis_timeout_s=2.0,
        redis_security=server.security("chatstore"),
        chunk_tokens=16,
        persist="off",
        **kw,
    )
    return AttentionStore(settings, TINY_SPEC, "fp")


def refusals(admin) -> list[str]:
    """What Redis's ACL refused since the reset: `reason object` per entry."""
    return [f"{e['reason']} {e['object']}" for e in admin.acl_log()]


def test_a_session_round_trips_through_tls_redis_as_the_acl_user(tmp_path, tls_server, admin):
    kv = value(40, seed=3)
    writer = remote_store(tmp_path, tls_server)
    assert writer.save("acme", "s1", kv) == "remote"
    # Another store (nothing local: no DRAM, no LMDB) reads the record and the chunks back. It
    # shares the data directory only for its secret key (encryption at rest), as replicas do.
    reader = remote_store(tmp_path, tls_server)
    assert lookup(reader, "acme", "s1").equal(kv)
    assert saved_tokens(reader, "acme", "s1") == kv.token_ids
    leases = session_leases(reader.records, 5.0, "r1")
    lease = leases.acquire(reader.key("acme", "s1"))
    assert lease is not None and leases.acquire(reader.key("acme", "s1")) is None
    leases.release(lease)
    names = [n.decode() for n in admin.scan_iter(count=1000)]
    assert names and all(n.startswith("chatstore:") for n in names), names
    assert any(n.startswith("chatstore:kv:") for n in names)
    assert reader.delete_session("acme", "s1")
    assert writer.records.get(writer.key("acme", "s1")) is None  # the shared record went
    # its chunks stay: no replica deletes a shared chunk (Redis's maxmemory policy evicts)
    assert any(n.startswith(b"chatstore:kv:") for n in admin.scan_iter(count=1000))
    for store in (writer, reader):
        store.close()
    assert refusals(admin) == []  # every command the store, records and leases sent was allowed


def test_the_acl_user_may_touch_chatstore_keys_only(tls_server, admin):
    client = connect_redis(tls_server.url, 2.0, security=tls_server.security("chatstore"))
    client.set("chatstore:kv:probe", b"x")
    assert client.get("chatstore:kv:probe") == b"x"
    with pytest.raises(redis_lib.exceptions.NoPermissionError):
        client.get("other:key")
    with pytest.raises(redis_lib.exceptions.NoPermissionError):
        client.flushall()
    assert sorted(refusals(admin)) == ["command flushall", "key other:key"]
    client.close()


def test_without_credentials_or_client_cert_redis_refuses(tls_server, tls_files):
    files = tls_files
    no_user = RedisSecurity(str(files.ca), str(files.client_cert), str(files.client_key))
    with pytest.raises(redis_lib.exceptions.AuthenticationError):  # `default` is off
        connect_redis(tls_server.url, 2.0, security=no_user).ping()
    no_cert = RedisSecurity(str(files.ca), username="chatstore", password="x")
    with pytest.raises(redis_lib.exceptions.ConnectionError):  # tls-auth-clients yes
        connect_redis(tls_server.url, 2.0, security=no_cert).ping()


def test_a_redis_cluster_over_tls(tmp_path, tls_cluster):
    admin = tls_cluster.admin_client()
    admin.acl_log_reset()
    url = f"rediss+cluster://127.0.0.1:{tls_cluster.port}"
    writer = remote_store(tmp_path, tls_cluster, url=url)
    kv = value(40, seed=5)
    assert writer.save("acme", "c1", kv) == "remote"
    reader = remote_store(tmp_path, tls_cluster, url=url)
    assert lookup(reader, "acme", "c1").equal(kv)
    assert type(reader.records.client).__name__ == "RedisCluster"
    for store in (writer, reader):
        store.close()
    assert refusals(admin) == []


def test_a_wrong_ca_refuses_and_the_store_serves_from_local_tiers(tmp_path, tls_server, tls_files):
    """The client trusts another CA: the handshake fails, as a ConnectionError, every time. The
    breaker counts it as an outage and opens; the DRAM and LMDB tiers keep the KV."""
    wrong = tls_server.security("chatstore", ca=tls_files.other_ca)
    client = connect_redis(tls_server.url, 2.0, security=wrong)
    with pytest.raises(redis_lib.exceptions.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
        client.ping()
    breaker = CircuitBreaker(failures=2, reset_s=60)
    remote = RedisTier(client, 1 << 20, "fp", ttl_s=60, timeout_s=2.0, breaker=breaker)
    with pytest.raises(TierUnavailable):  # refused (the hierarchy reads a miss)
        remote.get(ChunkKey("acme", "ab" * 16))
    health = breaker.health()  # one outage, counted
    assert health.state == "closed" and health.failures == 1
    assert "CERTIFICATE_VERIFY_FAILED" in (health.last_error or "")

    settings = StoreSettings(
        data_dir=tmp_path,
        dram_bytes=64 * 16 * TOKEN_BYTES,
        ssd_bytes=1 << 20,
        redis_url=tls_server.url,
        redis_bytes=1 << 20,
        redis_timeout_s=2.0,
        redis_security=wrong,
        redis_breaker_failures=2,
        redis_breaker_reset_s=60,
        chunk_tokens=16,
        persist="write_through",
        # Records (and so the tenants' data keys) in LMDB: with them in the refused Redis, no
        # tenant's key could be read to seal its KV for LMDB either (docs/security.md).
        records_url="lmdb",
    )
    started = time.monotonic()
    store = AttentionStore(settings, TINY_SPEC, "fp")
    assert time.monotonic() - started < 30  # liveness: a refused handshake is not a hang
    chunk = ChunkKey("acme", "ab" * 16)
    store.tiers.put(chunk, value(16, seed=1))
    assert store.tiers.persist(chunk)  # LMDB takes it
    assert store.tier("ssd").contains(chunk)
    with store.tiers.lock:
        store.tier("dram").delete(chunk)
    assert store.tiers.get(chunk).equal(value(16, seed=1))  # read back from LMDB
    assert not store.tier("remote").contains(chunk) and not store.tiers.share(chunk)
    with pytest.raises(TierUnavailable):  # the KV Redis refuses the handshake: an outage
        store.tier("remote").get(chunk)
    health = store.redis_breaker.health()
    assert health.failures >= 1 and "CERTIFICATE_VERIFY_FAILED" in (health.last_error or "")
    store.close()
    remote.close()


def test_tls_options_are_checked_before_connecting(tls_files):
    ca = str(tls_files.ca)
    with pytest.raises(ValueError, match="not rediss"):
        load_config(overrides={"redis_url": "redis://127.0.0.1:1/0", "redis_tls_ca_file": ca})
    with pytest.raises(ValueError, match="go together"):
        RedisSecurity(cert_file=str(tls_files.client_cert)).validate("rediss://127.0.0.1:1")
    with pytest.raises(ValueError, match="not a readable file"):
        RedisSecurity(ca_file="/nonexistent/ca.pem").validate("rediss://127.0.0.1:1")
    config = load_config(
        overrides={"redis_url": "rediss://127.0.0.1:1/0", "redis_tls_ca_file": ca},
        env={"CHATSTORE_REDIS_USERNAME": "chatstore", "CHATSTORE_REDIS_PASSWORD": "pw"},
    )
    security = StoreSettings.from_config(config).redis_security
    assert (security.ca_file, security.username, security.password) == (ca, "chatstore", "pw")
    assert "pw" not in repr(security)
    plain = RedisSecurity(username="u", password="p").client_kwargs("redis://h:1/0")
    assert plain == {"username": "u", "password": "p"}  # no ssl_* for a plain connection


@pytest.mark.model
def test_a_server_whose_redis_refuses_its_certificate_starts_and_keeps_serving(
    default_model, tmp_path, tls_server, tls_files
):
    """The whole server on a wrong CA: it starts, answers health checks, reports the open
    breaker and why, and refuses turns (their records live in Redis) with a quick 503, never a
    500 or a hang; the same server on the right CA serves the turn."""
    wrong = {
        "redis_url": tls_server.url,
        "redis_tls_ca_file": str(tls_files.other_ca),
        "redis_tls_cert_file": str(tls_files.client_cert),
        "redis_tls_key_file": str(tls_files.client_key),
        "redis_username": "chatstore",
        "redis_password": tls_server.security().password,
        "redis_timeout_s": 1.0,
        "kv_cache_bytes": 32 << 20,
        "dram_bytes": 64 << 20,
    }
    with (
        local_server(tmp_path / "wrong", default_model, **wrong) as server,
        httpx.Client(base_url=server.url, timeout=120) as http,
    ):
        assert http.get("/healthz").status_code == 200
        started = time.monotonic()
        turn = http.post("/v1/chat/completions", json=_turn())
        assert turn.status_code == 503, turn.text
        assert turn.json()["error"]["code"] == "store_unavailable"
        assert time.monotonic() - started < 30  # liveness bound, not a speed goal
        breaker = http.get("/admin/cache").json()["remote_breaker"]
        assert breaker["state"] == "open"
        assert "CERTIFICATE_VERIFY_FAILED" in breaker["last_error"]
        assert "chatstore_remote_breaker_open 1.0" in http.get("/metrics").text
    right = {**wrong, "redis_tls_ca_file": str(tls_files.ca)}
    with (
        local_server(tmp_path / "right", default_model, **right) as server,
        httpx.Client(base_url=server.url, timeout=120) as http,
    ):
        turn = http.post("/v1/chat/completions", json=_turn())
        assert turn.status_code == 200, turn.text


def _turn() -> dict:
    return {
        "model": "default",
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 2,
        "temperature": 0,
    }
