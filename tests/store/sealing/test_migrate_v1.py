"""Records sealed by version 1 (keys derived from the old secret) migrate to envelope keys.

Real LMDB and a real redis-server. Each store is written by the current code, then every record
value is rewritten as version 1 sealed it (tests/support/v1_seal.py, from the old format, not
from the migration's code); a server with a new master key then reads none of them until
`migrate-v1` (sealing/reseal.py) runs with the old secret: they read back equal, sessions, log
entries and stored Responses of both kinds, and are found by prefix and counted again; a tenant
shredded under version 1 stays unopenable; a clear value is never adopted; a job stopped midway
resumes from its cursor.
"""

from __future__ import annotations

import base64
import json
import logging
import os
from pathlib import Path

import lmdb
import pytest

from chatstore.private_file import write_private
from chatstore.store.record_keys import key_digest
from chatstore.store.records import redis_log
from chatstore.store.records.lmdb import LmdbRecordStore
from chatstore.store.records.lmdb_log import header_json
from chatstore.store.records.record import SessionRecord
from chatstore.store.records.redis import RedisRecordStore
from chatstore.store.records.responses import ResponseRecord
from chatstore.store.sealing import (
    RECORD_PURPOSE,
    Keyring,
    KeyringError,
    OpenError,
    Sealer,
    load_master_secrets,
)
from chatstore.store.sealing import reseal as reseal_module
from chatstore.store.sealing.key_store_lmdb import LmdbKeyStore
from chatstore.store.sealing.key_store_redis import RedisKeyStore
from chatstore.store.sealing.legacy_v1 import LegacyOpener
from chatstore.store.sealing.master_key import Secret
from chatstore.store.sealing.reseal import Resealer
from chatstore.store.sealing.sealer import read_header
from chatstore.store.session_kv import SessionKey
from tests.support.v1_seal import to_v1_lmdb, to_v1_redis

pytestmark = pytest.mark.timeout(120)

FP = "fp"
OLD_RESPONSES = "\x00responses:alice"  # a stored Response of the layout before its namespace


def secret(key_id: str) -> Secret:
    return Secret(key_id, os.urandom(32))


def write_conversations(records) -> dict[SessionKey, SessionRecord]:
    """alice: a three-turn session (a header and a log) and stored Responses of both layouts;
    bob: one turn; carol: one turn (shredded under version 1 below). The records as read."""
    written = {}
    for tenant, turns in (("alice", 3), ("bob", 1), ("carol", 1)):
        key, version, tokens = SessionKey(tenant, f"{tenant}-s"), 0, []
        for i in range(turns):
            tokens += [1000 * i + j for j in range(80)]
            messages = [
                {"role": "user", "content": f"{tenant} asks {i}"},
                {"role": "assistant", "content": f"{tenant} answers {i}"},
            ]
            version = records.append_turn(
                key, version, messages, token_ids=list(tokens), fingerprint=FP
            ).version
        written[key] = records.get(key)
    records.responses.create(
        ResponseRecord("alice", "resp_1", '{"id": "resp_1"}', "alice-s", [{"role": "user"}])
    )
    old = SessionRecord(OLD_RESPONSES, "resp_0", [{"role": "user", "content": "old"}])
    records.put(old)
    written[old.key] = records.get(old.key)
    return written


def same(a: SessionRecord | None, b: SessionRecord | None) -> bool:
    assert a is not None and b is not None
    return json.loads(a.to_json()) == json.loads(b.to_json())


def b64(material: bytes) -> str:
    return base64.b64encode(material).decode()


def legacy_file(tmp_path: Path, old: Secret) -> Path:
    """The old `<data_dir>/secret.key`, moved out of the data directory (mode 0600)."""
    path = tmp_path / "legacy-v1.key"
    write_private(path, f"{old.key_id}:{b64(old.material)}\n")
    return path


def raw_values(env) -> dict[bytes, bytes]:
    with env.begin() as txn:
        return {bytes(n): bytes(v) for n, v in txn.cursor()}


def test_lmdb_v1_records_migrate_resumably_a_shredded_tenant_and_a_clear_value_stay(
    tmp_path, monkeypatch, caplog
):
    data, old = tmp_path / "data", secret("k1")
    # -- a version-1 data directory: records sealed under keys derived from `old` --------------
    writer_keys = LmdbKeyStore(tmp_path / "writer-keys.lmdb")  # only to write them: dropped
    writer = Sealer(Keyring([secret("w")], writer_keys))
    records = LmdbRecordStore(data / "records.lmdb", sealer=writer)
    written = write_conversations(records)
    records.close()
    values = to_v1_lmdb(data / "records.lmdb", writer, old)  # heads, log entries, Responses
    writer_keys.close()
    # carol was shredded under version 1: her generation went up after her values were sealed
    write_private(data / "shredded.json", json.dumps({"generations": {"carol": 1}}))
    env = lmdb.open(str(data / "records.lmdb"), subdir=True)
    with env.begin(write=True) as txn:
        txn.put(b"m:prefix-index", b"1")  # version 1's marker: the upgraded start indexes anew
        # A value planted in the clear under a session's name: never adopted by the migration.
        planted = SessionRecord("dave", "dave-s", [{"role": "user", "content": "planted"}])
        name = LmdbRecordStore._prefix("dave") + key_digest(planted.key).encode()
        txn.put(name, header_json(planted, 0))
    before = raw_values(env)
    env.close()

    # -- the upgraded server: a new master key, data keys made as tenants are sealed ----------
    keys = LmdbKeyStore(data / "keys.lmdb")
    master = secret("m1")
    keyring = Keyring([master], keys)
    with caplog.at_level(logging.WARNING):
        records = LmdbRecordStore(data / "records.lmdb", sealer=Sealer(keyring))
    assert "sealed by version 1" in caplog.text and "migrate-v1" in caplog.text  # the start says
    for key in written:
        assert records.get(key) is None  # before the migration: absent
    assert records.responses.get("alice", "resp_1") is None
    alice = written[SessionKey("alice", "alice-s")]
    assert records.match_prefix("alice", alice.token_ids, FP) is None
    erin = records.create(SessionRecord("erin", "erin-s", [{"role": "user", "content": "new"}]))
    erin_name = LmdbRecordStore._prefix("erin") + key_digest(erin.key).encode()
    erin_raw = raw_values(records.env)[erin_name]  # version 2: not the migration's business

    # No legacy secret given to the process: nothing starts.
    monkeypatch.delenv("CHATSTORE_LEGACY_SECRET_KEY", raising=False)
    monkeypatch.delenv("CHATSTORE_LEGACY_SECRET_FILE", raising=False)
    with pytest.raises(KeyringError, match="CHATSTORE_LEGACY_SECRET_FILE"):
        Resealer(keyring, records, [], data).start("migrate-v1")
    # Nor from inside the data directory (where version 1 kept it).
    inside = data / "secret.key"
    write_private(inside, legacy_file(tmp_path, old).read_text())
    monkeypatch.setenv("CHATSTORE_LEGACY_SECRET_FILE", str(inside))
    with pytest.raises(KeyringError, match="inside the data directory"):
        Resealer(keyring, records, [], data).start("migrate-v1")
    inside.unlink()

    # -- the migration, stopped after two batches (a crash), then resumed ----------------------
    monkeypatch.setenv("CHATSTORE_LEGACY_SECRET_FILE", str(legacy_file(tmp_path, old)))
    monkeypatch.setattr(reseal_module, "BATCH", 3)
    batches = []

    def crash_after_two() -> None:
        batches.append(1)
        if len(batches) == 2:
            raise RuntimeError("simulated crash")

    job = Resealer(keyring, records, [], data, on_batch=crash_after_two)
    job.start("migrate-v1")
    assert job.wait(30) and job.progress.error and not job.progress.done
    assert job.progress.phase == "records" and job.progress.resealed > 0
    resumed = Resealer(keyring, records, [], data)  # a new process: the cursor from disk
    assert resumed.progress.cursor == job.progress.cursor
    resumed.start("migrate-v1")
    assert resumed.wait(30) and resumed.progress.done, resumed.progress
    carols = [n for n in before if n.startswith((b"t:carol/", b"u:carol/"))]
    assert len(carols) == 2  # her header and log entry
    # Every version-1 value but carol's, once: none twice, none missed; carol's did not open.
    assert resumed.progress.resealed == values - len(carols)
    assert resumed.progress.unopened == len(carols)

    # -- after: every record reads back equal through the store ------------------------------
    for key, record in written.items():
        if key.tenant == "carol":
            assert records.get(key) is None  # shredded under version 1: stays unopenable
        else:
            assert same(records.get(key), record), key
    response = records.responses.get("alice", "resp_1")
    assert response is not None and response.body_json == '{"id": "resp_1"}'
    assert records.match_prefix("alice", alice.token_ids, FP) == "alice-s"  # indexed again
    assert records.count_sessions("alice") == 1 and records.count_sessions("bob") == 1
    after = raw_values(records.env)
    assert all(after[n] == before[n] and after[n][0] == 1 for n in carols)
    assert after[name] == before[name]  # the clear value: untouched, and still absent
    assert after[erin_name] == erin_raw and same(records.get(erin.key), erin)
    assert records.get(planted.key) is None
    migrated = [n for n in before if n[:2] in (b"r:", b"t:", b"u:") and n not in carols]
    assert all(read_header(after[n]).dek_id == "d1" for n in migrated if n != name)
    records.close()

    # A restart with the new master key alone (no legacy secret) reads them: they are version 2.
    monkeypatch.delenv("CHATSTORE_LEGACY_SECRET_FILE")
    records = LmdbRecordStore(data / "records.lmdb", sealer=Sealer(Keyring([master], keys)))
    assert same(records.get(alice.key), alice) and records.open_failures == 0
    records.close()
    keys.close()


def test_redis_v1_records_migrate_and_a_tenant_shredded_on_a_replica_stays(
    redis_client, tmp_path, monkeypatch
):
    """The records in Redis (replicas): version 1's shred generations were in shredded.json
    and in the hash replicas shared (`chatstore:shred`); the higher one counts."""
    old, master = secret("k1"), secret("m1")
    writer = Sealer(Keyring([secret("w")]))  # its data keys in memory: gone with it
    records = RedisRecordStore(redis_client, sealer=writer)
    written = write_conversations(records)
    values = to_v1_redis(redis_client, writer, old)
    redis_client.hset("chatstore:shred", "carol", 1)  # shredded on another replica, under v1
    redis_client.hdel(records._index_name("alice"), records.INDEX_BUILT)  # v1's index: rebuilt
    carol = records._name(SessionKey("carol", "carol-s"))
    carols = {carol: redis_client.get(carol)}
    carols_log = redis_client.lrange(redis_log.log_name(carol), 0, -1)

    keyring = Keyring([master], RedisKeyStore(redis_client))
    records = RedisRecordStore(redis_client, sealer=Sealer(keyring))
    assert all(records.get(key) is None for key in written)
    alice = written[SessionKey("alice", "alice-s")]
    assert records.match_prefix("alice", alice.token_ids, FP) is None

    monkeypatch.setenv("CHATSTORE_LEGACY_SECRET_KEY", f"{old.key_id}:{b64(old.material)}")
    job = Resealer(keyring, records, [], tmp_path)
    job.start("migrate-v1")
    assert job.wait(30) and job.progress.done, job.progress
    assert job.progress.unopened == 1 + len(carols_log)  # carol's header and log entry
    # alice's, bob's and the old-layout Response's sessions, and resp_1: Redis rewrites a
    # session's header and log entries in one transaction, counted once.
    assert values == 11 and job.progress.resealed == 4
    for key, record in written.items():
        if key.tenant == "carol":
            assert records.get(key) is None
        else:
            assert same(records.get(key), record), key
    assert records.responses.get("alice", "resp_1") is not None
    assert records.match_prefix("alice", alice.token_ids, FP) == "alice-s"
    assert records.count_sessions("alice") == 1
    assert redis_client.get(carol) == carols[carol]  # left as it was: a miss, not a delete
    assert redis_client.lrange(redis_log.log_name(carol), 0, -1) == carols_log
    # The generation is what keeps carol's values shut: under generation 0 they would open.
    opener = LegacyOpener([old], {})
    assert json.loads(opener.open(RECORD_PURPOSE, "carol", carol.encode(), carols[carol]))
    with pytest.raises(OpenError):
        LegacyOpener([old], {"carol": 1}).open(
            RECORD_PURPOSE, "carol", carol.encode(), carols[carol]
        )


def test_a_version_1_secret_left_in_the_data_dir_is_refused_naming_the_migration(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))  # never the real one
    data = tmp_path / "data"
    data.mkdir()
    write_private(data / "secret.key", f"k1:{b64(os.urandom(32))}\n")  # version 1's default
    with pytest.raises(KeyringError, match="inside the data directory") as refused:
        load_master_secrets(data)
    assert "migrate-v1" in str(refused.value) and "CHATSTORE_LEGACY_SECRET_FILE" in str(
        refused.value
    )
