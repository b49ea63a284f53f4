"""Store-side reliability: a deleted session stays deleted (a late save of an older turn is
dropped, the record is not re-created), records are tied to the model that made their ids,
record writes that cannot be made durable raise, and LMDB records are private to the user."""

from __future__ import annotations

import os
import stat
import time

import pytest

from chatstore.store.attention_store import AttentionStore
from chatstore.store.records.lmdb import LmdbRecordStore
from chatstore.store.records.record import RecordStoreFull, SessionRecord
from chatstore.store.sealing import Keyring, Sealer
from chatstore.store.sealing.master_key import Secret
from chatstore.store.session_kv import SessionKey
from chatstore.store.session_store import SessionStore
from chatstore.store.settings import StoreSettings
from tests.support.chunk_store import CHUNK, make, turn
from tests.support.store import TINY_SPEC

IDS = list(range(1, 3 * CHUNK + 3))


def _save_turn_opened_at(store: AttentionStore, sid: str, ids: list[int], opened: float) -> None:
    """`turn` of test_store_chunks, for a turn that began at `opened` (monotonic)."""
    real = store.save_plan

    def save_plan(tenant, session_id, plan, build, nbytes, opened_at=None):
        return real(tenant, session_id, plan, build, nbytes, opened)

    store.save_plan = save_plan  # type: ignore[method-assign]
    try:
        turn(store, "t", sid, ids)
    finally:
        del store.save_plan


@pytest.mark.parametrize("async_save", [False, True])
def test_late_save_of_a_turn_begun_before_delete_is_dropped(tmp_path, async_save):
    store = make(tmp_path, async_save=async_save)
    turn(store, "t", "s", IDS[:CHUNK])
    opened = time.monotonic()  # the turn in flight when the client deletes the session
    assert store.delete_session("t", "s")
    _save_turn_opened_at(store, "s", IDS, opened)
    assert store.flush_writes(10)
    assert store.records.get(SessionKey("t", "s")) is None
    assert store.find("t", "s") is None
    assert store.tiers.keys() == set()  # nothing of it kept in any tier
    # The id reused by a new session afterwards saves normally.
    _save_turn_opened_at(store, "s", IDS, time.monotonic())
    assert store.flush_writes(10)
    assert store.find("t", "s") is not None
    assert store.records.get(SessionKey("t", "s")).token_ids == IDS


def test_records_of_another_model_are_not_reused(tmp_path):
    store = make(tmp_path, persist="write_through")
    turn(store, "t", "s", IDS)
    assert store.flush_persist(10)
    record = store.records.get(SessionKey("t", "s"))
    assert record.fingerprint == "fp" and record.token_ids == IDS
    store.close()
    other = AttentionStore(
        StoreSettings(
            data_dir=tmp_path,
            dram_bytes=1 << 20,
            ssd_bytes=1 << 22,
            block_size=4,
            chunk_tokens=CHUNK,
            persist="off",
        ),
        TINY_SPEC,
        "another-model",
    )
    try:
        assert other.find("t", "s") is None
        adapter = SessionStore(other.records, other)
        port = adapter.get("t", "s")
        assert port is not None and port.token_ids == []  # messages stay, foreign ids do not
        assert adapter.match_prefix("t", IDS) is None
    finally:
        other.close()


def test_lmdb_records_full_raises_and_recovers_after_delete(tmp_path):
    records = LmdbRecordStore(tmp_path / "records.lmdb", map_size=1 << 20)
    big = {"blob": "x" * 20_000}
    kept = []
    with pytest.raises(RecordStoreFull, match="records_map_bytes"):
        for i in range(200):
            records.put(SessionRecord("t", f"s{i}", metadata=big))
            kept.append(SessionKey("t", f"s{i}"))
    assert 10 < len(kept) < 60
    with pytest.raises(RecordStoreFull):
        records.upsert(SessionKey("t", "new"), metadata=big)
    for key in kept[:5]:  # deleting works on a full store and makes room again
        assert records.delete(key)
    records.upsert(SessionKey("t", "new"), metadata=big)
    assert records.get(SessionKey("t", "new")).metadata == big
    records.close()


@pytest.mark.parametrize("sealed", [False, True])
@pytest.mark.parametrize("pad", [3_000, 15_000, 40_000])
def test_every_session_of_a_full_lmdb_store_can_be_deleted(tmp_path, pad, sealed):
    """Deletes in a row on a full map: LMDB reuses a commit's freed pages only two commits
    later, so each lives on the room writes left. With 16 pages of room (the old 1/16 of a
    1 MiB map) the second delete of sealed 15 KB records found the map full, and every one
    after it (CI: a 507 to DELETE /v1/sessions)."""
    sealer = Sealer(Keyring([Secret("k1", os.urandom(32))])) if sealed else None
    path = tmp_path / "records.lmdb"
    records = LmdbRecordStore(path, ttl_s=3600, map_size=1 << 20, sealer=sealer)
    kept = []
    for metadata in ({"pad": "x" * pad}, {}):  # big sessions until full, then bare ones
        with pytest.raises(RecordStoreFull):
            for _ in range(2000):
                record = SessionRecord("t", f"s{len(kept)}", metadata=metadata)
                records.put(record)
                kept.append(record.key)
    for key in kept:
        assert records.delete(key)
    assert records.count_sessions("t") == 0
    records.close()


def test_lmdb_records_are_private_and_listed_per_tenant(tmp_path):
    path = tmp_path / "records.lmdb"
    records = LmdbRecordStore(path)
    for tenant in ("a", "b", "a:b", "a/"):
        records.put(SessionRecord(tenant, "s"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    for f in path.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    assert [r.tenant for r in records.list_sessions("a")] == ["a"]
    assert [r.tenant for r in records.list_sessions("a:b")] == ["a:b"]
    assert records.count_sessions("a/") == 1
    assert len(records.list_sessions()) == 4
    records.close()


def test_lmdb_records_of_the_old_key_layout_are_migrated(tmp_path):
    import lmdb

    from chatstore.store.record_keys import key_digest

    path = tmp_path / "records.lmdb"
    env = lmdb.open(str(path), map_size=1 << 20)
    record = SessionRecord("acme", "s1", messages=[{"role": "user", "content": "hi"}])
    with env.begin(write=True) as txn:  # how records were keyed before: the digest alone
        txn.put(key_digest(record.key).encode(), record.to_json())
    env.close()
    records = LmdbRecordStore(path)
    assert records.get(record.key).messages == record.messages
    assert [r.session_id for r in records.list_sessions("acme")] == ["s1"]
    records.close()
