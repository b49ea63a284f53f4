"""Session leases across replicas sharing one Redis: one holder at a time (SET NX PX), renewed
while held, expiring after a holder crashes, released only by their holder; and two real
replicas (two servers on one Redis) that never run two turns of one session at once nor lose
an acknowledged turn."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from chatstore.store.records.leases import (
    LocalLeases,
    RedisLeases,
    lease_name,
    session_leases,
    session_tag,
)
from chatstore.store.records.lmdb import LmdbRecordStore
from chatstore.store.records.record import RecordStoreUnavailable
from chatstore.store.records.redis import RedisRecordStore
from chatstore.store.sealing import Keyring, Sealer
from chatstore.store.sealing.key_store_redis import RedisKeyStore
from chatstore.store.sealing.master_key import new_secret_line, parse_secrets
from chatstore.store.session_kv import SessionKey

KEY = SessionKey("t", "s")


@pytest.fixture
def records(redis_url):
    store = RedisRecordStore(redis_url)
    yield store
    store.close()


@pytest.fixture
def replicas(records):
    made: list[RedisLeases] = []

    def make(lease_s: float = 0.5, name: str = "") -> RedisLeases:
        made.append(RedisLeases(records, lease_s, name))
        return made[-1]

    yield make
    for leases in made:
        leases.close()


def crash(leases: RedisLeases) -> None:
    """The replica dies: its renewer stops, nothing is released."""
    leases._stop.set()
    leases._wake.set()
    if leases._thread is not None:
        leases._thread.join(5)


def test_one_holder_at_a_time_and_release_frees_it(replicas, redis_client):
    a, b = replicas(name="a"), replicas(name="b")
    lease = a.acquire(KEY)
    assert lease is not None and lease.token.startswith("a:")
    assert redis_client.get(lease_name(KEY)).decode() == lease.token
    assert b.acquire(KEY) is None
    assert a.acquire(KEY) is None  # one turn per session on a replica too
    assert b.acquire(SessionKey("t", "other")) is not None  # other sessions are free
    a.release(lease)
    assert redis_client.get(lease_name(KEY)) is None
    assert b.acquire(KEY) is not None


def test_renewed_while_held(replicas, redis_client):
    a, b = replicas(0.5), replicas(0.5)
    lease = a.acquire(KEY)
    time.sleep(1.3)  # 2.6 leases: the renewer kept it
    assert b.acquire(KEY) is None
    assert 0 < redis_client.pttl(lease_name(KEY)) <= 500
    assert not lease.lost
    a.release(lease)


def test_a_crashed_holder_s_lease_expires(replicas):
    a, b = replicas(0.5), replicas(0.5)
    assert a.acquire(KEY) is not None
    crash(a)
    assert b.acquire(KEY) is None
    deadline = time.monotonic() + 3
    while (taken := b.acquire(KEY)) is None:
        assert time.monotonic() < deadline, "the crashed replica's lease never expired"
        time.sleep(0.05)
    assert taken.token.split(":")[0] == b.replica.split(":")[0]


def test_release_never_deletes_another_holder_s_lease(replicas, redis_client):
    a, b = replicas(0.3), replicas(0.3)
    stale = a.acquire(KEY)
    crash(a)  # stops renewing (a long GC pause, a hung Redis): the lease runs out
    time.sleep(0.5)
    fresh = b.acquire(KEY)
    assert fresh is not None
    a._send_release(stale)  # the stale holder comes back and releases
    assert redis_client.get(lease_name(KEY)).decode() == fresh.token
    a._renew_all()  # nor does its renewal extend the other holder's lease
    assert stale.lost and redis_client.pttl(lease_name(KEY)) <= 300
    b.release(fresh)
    assert redis_client.get(lease_name(KEY)) is None


def test_a_lost_lease_is_marked(replicas):
    a = replicas(0.3)
    lease = a.acquire(KEY)
    a.records.client.delete(lease_name(KEY))  # expired under it
    deadline = time.monotonic() + 2
    while not lease.lost:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_release_in_the_background_and_before_the_next_acquire(replicas, redis_client):
    a = replicas(30)
    lease = a.acquire(KEY)
    a.release(lease, wait=False)
    again = a.acquire(KEY)  # sends the pending release first
    assert again is not None
    a.release(again, wait=False)
    deadline = time.monotonic() + 2
    while redis_client.get(lease_name(KEY)) is not None:
        assert time.monotonic() < deadline, "the background release never went out"
        time.sleep(0.02)


def test_redis_down_is_unavailable():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    records = RedisRecordStore(f"redis://127.0.0.1:{port}/0", timeout_s=0.2)
    leases = RedisLeases(records, 1.0)
    with pytest.raises(RecordStoreUnavailable):
        leases.acquire(KEY)
    leases.close()


def test_lease_shares_the_record_s_hash_slot(records):
    from redis.cluster import key_slot

    name = lease_name(KEY)
    assert name == f"chatstore:lease:{{{session_tag(KEY)}}}"
    record = records._name(KEY)
    if "{" in record:  # records keyed by the same tag (Redis Cluster)
        assert key_slot(name.encode()) == key_slot(record.encode())


def test_lmdb_records_get_local_no_op_leases(tmp_path):
    leases = session_leases(LmdbRecordStore(tmp_path / "r.lmdb"))
    assert isinstance(leases, LocalLeases)
    assert leases.acquire(KEY) is not None and leases.acquire(KEY) is not None


# -- two real replicas on one Redis ----------------------------------------------------------

LONG = {"max_tokens": 64, "ignore_eos": True, "temperature": 0}


# The replicas share one secret, as replicas must (encryption at rest: docs/security.md).
REPLICA_SECRET = new_secret_line()


@pytest.fixture(scope="module")
def two_replicas(default_model, tmp_path_factory, redis_server):
    from chatstore.server.launcher import local_server

    servers = [
        local_server(
            tmp_path_factory.mktemp(f"replica{i}"),
            default_model,
            kv_cache_bytes=32 << 20,
            dram_bytes=64 << 20,
            max_context_tokens=1024,
            redis_url=redis_server.url,
            redis_bytes=64 << 20,
            session_lease_s=2.0,
            replica_id=f"replica{i}",
            secret_key=REPLICA_SECRET,
        )
        for i in range(2)
    ]
    for server in servers:
        server.start()
    yield servers
    for server in servers:
        server.stop()


def race(clients: dict[str, httpx.Client], sid: str, tag: str) -> dict[str, httpx.Response]:
    """Every client posts a turn to the session at the same moment."""
    start = threading.Barrier(len(clients))
    answers: dict[str, httpx.Response] = {}

    def post(name: str) -> None:
        start.wait()
        body = {"content": f"{name}{tag}", **LONG}
        answers[name] = clients[name].post(f"/v1/sessions/{sid}/messages", json=body)

    threads = [threading.Thread(target=post, args=(name,)) for name in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers


@pytest.mark.model
@pytest.mark.timeout(300)
def test_two_replicas_one_turn_at_a_time_and_no_acknowledged_turn_lost(two_replicas):
    a, b = (httpx.Client(base_url=s.url, timeout=120) for s in two_replicas)
    sid = a.post("/v1/sessions", json={"system_prompt": "Count."}).json()["id"]
    acked: list[tuple[str, str]] = []  # (user content, reply) in acknowledgement order
    for round_ in range(3):
        answers = race({"a": a, "b": b}, sid, str(round_))
        codes = sorted(r.status_code for r in answers.values())
        assert codes == [200, 409], {k: r.text for k, r in answers.items()}
        for name, r in answers.items():
            if r.status_code == 200:
                acked.append((f"{name}{round_}", r.json()["message"]["content"]))
            else:
                assert r.json()["error"]["code"] == "session_busy"
                assert "another replica" in r.json()["error"]["message"]
    # A turn on B right after A's sees A's messages, and B's turn is in A's history after.
    r = a.post(f"/v1/sessions/{sid}/messages", json={"content": "seq-a", **LONG})
    assert r.status_code == 200, r.text
    acked.append(("seq-a", r.json()["message"]["content"]))
    r = b.post(f"/v1/sessions/{sid}/messages", json={"content": "seq-b", **LONG})
    assert r.status_code == 200, r.text
    acked.append(("seq-b", r.json()["message"]["content"]))
    for client in (a, b):
        messages = client.get(f"/v1/sessions/{sid}").json()["messages"]
        assert messages[0] == {"role": "system", "content": "Count."}
        turns = zip(messages[1::2], messages[2::2], strict=True)
        pairs = [(u["content"], r["content"]) for u, r in turns]
        assert pairs == acked
    a.close()
    b.close()


@pytest.mark.model
@pytest.mark.timeout(300)
def test_delete_on_one_replica_while_the_other_runs_a_turn_is_409(two_replicas):
    a, b = (httpx.Client(base_url=s.url, timeout=120) for s in two_replicas)
    sid = a.post("/v1/sessions", json={}).json()["id"]
    body = {"content": "Count to a hundred.", "stream": True, **LONG}
    with a.stream("POST", f"/v1/sessions/{sid}/messages", json=body) as response:
        lines = response.iter_lines()  # held: a dropped iterator closes the connection
        for line in lines:
            if line.startswith("data: ") and '"delta"' in line:
                break  # the turn runs on A
        r = b.delete(f"/v1/sessions/{sid}")
        assert r.status_code == 409 and r.json()["error"]["code"] == "session_busy"
        assert any('"done"' in line for line in lines)  # the turn went on
    assert b.delete(f"/v1/sessions/{sid}").status_code == 200
    assert a.get(f"/v1/sessions/{sid}").status_code == 404
    a.close()
    b.close()


@pytest.mark.model
@pytest.mark.timeout(300)
def test_a_turn_whose_session_changed_meanwhile_is_refused_not_overwritten(
    two_replicas, redis_server
):
    """A write that slipped past the lease (a lease lost to a hung Redis) is kept: the turn
    that read the older version gets 409 session_conflict instead of replacing it."""
    a = httpx.Client(base_url=two_replicas[0].url, timeout=120)
    sid = a.post("/v1/sessions", json={}).json()["id"]
    other = RedisRecordStore(redis_server.url)  # a third replica's view: its data keys too
    keys = RedisKeyStore(other.client)
    other.sealer = Sealer(Keyring(parse_secrets(REPLICA_SECRET, "test"), keys))
    key = SessionKey("local", sid)
    body = {"content": "mine", "stream": True, **LONG}
    with a.stream("POST", f"/v1/sessions/{sid}/messages", json=body) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: ") and '"delta"' in line:
                break
        theirs = [{"role": "user", "content": "theirs"}, {"role": "assistant", "content": "ok"}]
        other.append_turn(key, other.get(key).version, theirs)
        tail = [line for line in lines if line.startswith("data: {")]
    assert '"session_conflict"' in tail[-1] and '"done"' not in tail[-1]
    assert [m["content"] for m in a.get(f"/v1/sessions/{sid}").json()["messages"]] == [
        "theirs",
        "ok",
    ]
    other.close()
    a.close()


def test_a_release_lost_in_an_outage_does_not_lock_our_own_next_turn_out(replicas, redis_client):
    """Redis went down while a turn ended: its release never arrived. The replica's next turn
    on the session takes its own stale lease back; another replica still may not."""
    a, b = replicas(name="a"), replicas(name="b")
    lease = a.acquire(KEY)
    a.release(lease, wait=False)
    a._to_release.clear()  # what a release that failed against a dead Redis leaves behind
    assert redis_client.get(lease_name(KEY)).decode() == lease.token
    assert b.acquire(KEY) is None
    again = a.acquire(KEY)
    assert again is not None and again.token != lease.token
    assert redis_client.get(lease_name(KEY)).decode() == again.token
    assert b.acquire(KEY) is None
    a.release(again)
    assert b.acquire(KEY) is not None
