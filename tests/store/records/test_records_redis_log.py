"""A Redis session record is a header plus an append-only log (records/redis_log.py), like
LMDB's: a turn writes what it adds, not the conversation again. Against a real redis-server."""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict
from typing import Any

import pytest

from chatstore.store.records import lmdb_log, redis_log
from chatstore.store.records.lmdb import LmdbRecordStore
from chatstore.store.records.record import RecordConflict, SessionRecord
from chatstore.store.records.redis import RedisRecordStore
from chatstore.store.sealing import Keyring, Sealer
from chatstore.store.sealing.key_store_redis import RedisKeyStore
from chatstore.store.sealing.master_key import Secret
from chatstore.store.sealing.sealer import read_header
from chatstore.store.session_kv import SessionKey
from tests.support.records import server_turn
from tests.support.redis_server import redis_server_binary

pytestmark = pytest.mark.skipif(redis_server_binary() is None, reason="needs redis-server")

KEY = SessionKey("acme", "s")


def turn(records: Any, i: int, version: int, tokens: list[int]) -> int:
    return server_turn(records, KEY, i, version, tokens)


def net_in(client: Any) -> int:
    """Bytes Redis has received from all clients (INFO stats)."""
    return int(client.info("stats")["total_net_input_bytes"])


def names(records: RedisRecordStore, key: SessionKey = KEY) -> tuple[str, str]:
    header = records._name(key)
    return header, redis_log.log_name(header)


def test_a_turn_writes_only_what_it_adds(redis_client):
    records = RedisRecordStore(redis_client)
    records.create(SessionRecord("acme", "s"))
    header, logged = names(records)
    version, tokens, ours, theirs, header_bytes = 1, [], {}, {}, {}
    for i in range(1, 41):
        start, received = records.bytes_put, net_in(redis_client)
        version = turn(records, i, version, tokens)
        ours[i] = records.bytes_put - start
        theirs[i] = net_in(redis_client) - received
        header_bytes[i] = int(redis_client.memory_usage(header))
    whole = len(records.get(KEY).to_json())  # what the layout before wrote (twice a turn)
    assert ours[40] < 1.2 * ours[5] and theirs[40] < 1.3 * theirs[5]  # flat
    assert theirs[40] < whole / 5  # not the conversation again
    assert header_bytes[40] < 1.2 * header_bytes[5]  # the header holds none of the lists
    assert redis_client.llen(logged) == 1 + 40  # the create's base, then one a turn
    last = b"".join(redis_client.lrange(logged, -1, -1))
    assert b"answer-40-" in last and b"answer-39-" not in last
    record = records.get(KEY)
    assert len(record.messages) == 80 and record.messages[-1]["content"].startswith("answer-40-")
    assert record.token_ids == tokens and record.kv_tokens == len(tokens)
    assert record.chunks == [f"c{j}" for j in range(len(tokens) // 64)]
    assert RedisRecordStore(redis_client).get(KEY).messages == record.messages  # a replica


def comparable(record: SessionRecord | None) -> dict[str, Any] | None:
    if record is None:
        return None
    fields = asdict(record)
    for clock in ("created_at", "updated_at", "expires_at"):
        del fields[clock]
    return fields


def outcome(step: Any, store: Any) -> Any:
    """What step returned on store (records made comparable), or the error's type."""
    try:
        out = step(store)
    except RecordConflict:
        return RecordConflict
    if isinstance(out, SessionRecord) or out is None:
        return comparable(out)
    if isinstance(out, list):
        return sorted((comparable(r) for r in out), key=lambda f: f["session_id"])
    return out


def test_every_operation_returns_what_lmdb_does(redis_client, tmp_path, monkeypatch):
    """The same sequence on both stores, sealed, with a short log (new bases on the way)."""
    monkeypatch.setattr(lmdb_log, "MAX_ENTRIES", 4)
    secret = Secret("k1", os.urandom(32))
    redis = RedisRecordStore(redis_client, ttl_s=3600, sealer=Sealer(Keyring([secret])))
    lmdb = LmdbRecordStore(tmp_path / "records", ttl_s=3600, sealer=Sealer(Keyring([secret])))
    other = SessionKey("acme", "t")
    msg = [{"role": "user", "content": "hi"}]
    steps: list[Any] = [
        lambda s: s.create(SessionRecord("acme", "s", [{"role": "system", "content": "sys"}])),
        lambda s: s.create(SessionRecord("acme", "s")),  # exists: a conflict
        lambda s: s.upsert(KEY, token_ids=[1, 2, 3], chunks=["c0"], fingerprint="fp"),
        lambda s: s.append_turn(KEY, 1, msg, kv_tokens=3, last_token=9),
        lambda s: s.append_turn(KEY, 1, msg),  # stale: a conflict
        *[lambda s, i=i: s.append_turn(KEY, 1 + i, [{"role": "x", "content": i}]) for i in (1, 2)],
        lambda s: s.append_turn(KEY, 4, [{"role": "user", "content": "edited"}], keep=2),
        lambda s: s.upsert(KEY, token_ids=[7, 8], chunks=[]),  # a truncation
        lambda s: s.patch(KEY, priority=3, ttl_s=60),
        lambda s: s.patch(SessionKey("acme", "nope"), priority=1),
        lambda s: s.upsert(other, token_ids=list(range(300)), chunks=["a", "b"]),
        *[lambda s, i=i: s.upsert(other, token_ids=list(range(300 + i))) for i in range(6)],
        lambda s: s.get(KEY),
        lambda s: s.get(other),
        lambda s: s.list_sessions("acme"),
        lambda s: s.restore_sessions(),
        lambda s: s.count_sessions("acme"),
        lambda s: s.match_prefix("acme", list(range(300)), ""),
        lambda s: s.delete(KEY),
        lambda s: s.delete(KEY),
        lambda s: s.get(KEY),
        lambda s: s.append_turn(KEY, 0, msg),  # a fresh session under the same id
        lambda s: s.list_sessions(),
        lambda s: s.delete_tenant("acme"),
        lambda s: s.list_sessions(),
    ]
    for i, step in enumerate(steps):
        assert outcome(step, redis) == outcome(step, lmdb), f"step {i}"
    assert redis.open_failures == lmdb.open_failures == 0
    assert redis_client.keys(f"{redis_log.LOG_PREFIX}*") == []  # delete_tenant took the logs
    lmdb.close()


def test_a_whole_record_of_the_older_layout_reads_and_moves_to_a_log(redis_client):
    records = RedisRecordStore(redis_client, ttl_s=600)
    old = SessionRecord("acme", "s", [{"role": "user", "content": "before"}], token_ids=[1, 2])
    header, logged = names(records)
    redis_client.set(header, old.to_json(), ex=600)  # as the version before wrote it: one value
    got = records.get(KEY)
    assert got.messages == old.messages and got.token_ids == [1, 2]
    assert not redis_client.exists(logged)  # no start-up pass: read as is
    records.append_turn(KEY, old.version, [{"role": "assistant", "content": "after"}])
    stored = json.loads(redis_client.get(header))
    assert stored["log"] == 1 and "messages" not in stored  # its first write made a base
    assert redis_client.llen(logged) == 1
    assert 590 <= redis_client.ttl(logged) <= 600
    got = records.get(KEY)
    assert [m["content"] for m in got.messages] == ["before", "after"] and got.token_ids == [1, 2]
    assert records.delete(KEY) and not redis_client.exists(header, logged)


def test_concurrent_writers_get_a_conflict(redis_client, redis_url):
    replicas = [RedisRecordStore(redis_url) for _ in range(6)]
    replicas[0].create(SessionRecord("acme", "s"))
    barrier, won, lost = threading.Barrier(len(replicas)), [], []

    def write(i: int) -> None:
        barrier.wait()
        try:
            replicas[i].append_turn(KEY, 1, [{"role": "user", "content": f"from {i}"}])
            won.append(i)
        except RecordConflict:
            lost.append(i)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(len(replicas))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(lost) == len(replicas) - 1
    record = replicas[0].get(KEY)
    assert record.version == 2 and [m["content"] for m in record.messages] == [f"from {won[0]}"]
    assert redis_client.llen(names(replicas[0])[1]) == 2

    # A write that lands between another's read and its EXEC: that one's EXEC is refused
    # (WATCH of the header), it reads again and finds the new version.
    a, b = replicas[:2]
    seen: list[int] = []

    def stale(current: SessionRecord | None) -> SessionRecord:
        assert current is not None
        seen.append(current.version)
        if len(seen) == 1:
            a.append_turn(KEY, current.version, [{"role": "user", "content": "a"}])
        if current.version != 2:
            raise RecordConflict(f"at {current.version}")
        current.messages.append({"role": "user", "content": "b"})
        return current

    with pytest.raises(RecordConflict):
        b._update(KEY, stale)
    assert seen == [2, 3]
    assert [m["content"] for m in b.get(KEY).messages] == [f"from {won[0]}", "a"]


def test_expiry_removes_header_and_log_together(redis_client):
    records = RedisRecordStore(redis_client, ttl_s=0)
    records.create(SessionRecord("acme", "s", [{"role": "user", "content": "x"}], ttl_s=1))
    records.create(SessionRecord("acme", "forever", [{"role": "user", "content": "y"}]))
    header, logged = names(records)
    assert redis_client.pexpiretime(header) == redis_client.pexpiretime(logged) > 0
    assert redis_client.ttl(records._name(SessionKey("acme", "forever"))) == -1
    assert redis_client.ttl(names(records, SessionKey("acme", "forever"))[1]) == -1
    deadline = time.time() + 5
    while redis_client.exists(header, logged) and time.time() < deadline:
        time.sleep(0.1)
    assert redis_client.exists(header, logged) == 0 and records.get(KEY) is None
    assert records.purge_expired() == [] and records.count_sessions("acme") == 1
    assert records.open_failures == 0


def test_reseal_covers_the_log_and_a_moved_entry_does_not_open(redis_client):
    master, keys = Secret("k1", os.urandom(32)), RedisKeyStore(redis_client)
    keyring = Keyring([master], keys)
    records = RedisRecordStore(redis_client, ttl_s=600, sealer=Sealer(keyring))
    version, tokens = 0, []
    for i in range(1, 4):
        version = turn(records, i, version, tokens)
    before = records.get(KEY)
    assert keyring.add_data_key("acme", older_than=time.time() + 1)  # a data-key rotation
    rotated = RedisRecordStore(redis_client, ttl_s=600, sealer=Sealer(Keyring([master], keys)))
    cursor, done = b"", 0
    while cursor is not None:
        n, cursor = rotated.reseal_all(cursor, batch=1)
        done += n
    assert done == 1  # one record: its header and every entry
    header, logged = names(records)
    entries = redis_client.lrange(logged, 0, -1)
    assert len(entries) == 3  # one a turn (the record was made by its first turn)
    assert {read_header(v).dek_id for v in [redis_client.get(header), *entries]} == {"d2"}
    assert 590 <= redis_client.ttl(logged) <= 600 and 590 <= redis_client.ttl(header) <= 600
    assert keyring.retire_data_keys("acme")  # d1 is gone: everything still opens
    only_new = RedisRecordStore(redis_client, ttl_s=600, sealer=Sealer(Keyring([master], keys)))
    assert comparable(only_new.get(KEY)) == comparable(before)
    assert rotated.reseal_all(b"", batch=8)[0] == 0  # a second pass: nothing left to rewrite

    # Two entries swapped in place, or one under another session's log: neither opens. (A
    # store that read the record keeps its lists while the header it read is what Redis
    # holds, LogCache: it serves what it verified; a store reading the log now is refused.)
    redis_client.lset(logged, 0, entries[1])
    redis_client.lset(logged, 1, entries[0])
    fresh = RedisRecordStore(redis_client, ttl_s=600, sealer=Sealer(Keyring([master], keys)))
    assert fresh.get(KEY) is None and fresh.open_failures > 0
    redis_client.lset(logged, 0, entries[0])
    redis_client.lset(logged, 1, entries[1])
    assert comparable(only_new.get(KEY)) == comparable(before)
    other = SessionKey("acme", "t")
    only_new.upsert(other, token_ids=[5])
    redis_client.lset(names(only_new, other)[1], 0, entries[0])
    assert fresh.get(other) is None


def test_a_cached_record_is_read_again_once_another_replica_wrote_it(redis_client):
    """Each store keeps the lists it last read or wrote (LogCache), valid only while Redis
    holds the header they came with: another replica's turn replaces the header, so the next
    read and the next write see it, and no turn of either replica is lost."""
    a, b = RedisRecordStore(redis_client), RedisRecordStore(redis_client)
    version, tokens = 0, []
    version = turn(a, 1, version, tokens)
    assert len(b.get(KEY).messages) == 2  # b has read (and cached) turn 1
    version = turn(a, 2, version, tokens)
    assert [m["content"][:11] for m in b.get(KEY).messages][-1] == "answer-2-aa"
    version = turn(b, 3, version, list(tokens))  # b writes on top of a's turn 2
    got = a.get(KEY)
    assert len(got.messages) == 6 and got.version == version
