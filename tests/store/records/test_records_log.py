"""An LMDB session record is a header plus an append-only log (records/lmdb_log.py): a turn
writes what it adds, not the conversation again."""

from __future__ import annotations

import json
from typing import Any

from chatstore.store.records import lmdb_log
from chatstore.store.records.lmdb import LmdbRecordStore
from chatstore.store.records.lmdb_facts import key_range
from chatstore.store.records.record import SessionRecord
from chatstore.store.session_kv import SessionKey
from tests.support.records import server_turn

KEY = SessionKey("acme", "s")


def turn(records: Any, i: int, version: int, tokens: list[int]) -> int:
    return server_turn(records, KEY, i, version, tokens)


def written(records: LmdbRecordStore) -> dict[bytes, bytes]:
    with records.env.begin() as txn:
        return dict(key_range(txn, b"t:") + key_range(txn, lmdb_log.LOG))


def test_a_turn_writes_only_what_it_adds(tmp_path):
    records = LmdbRecordStore(tmp_path / "records")
    records.create(SessionRecord("acme", "s"))
    version, tokens, cost = 1, [], {}
    for i in range(1, 41):
        before, start = written(records), records.bytes_put
        version = turn(records, i, version, tokens)
        cost[i] = records.bytes_put - start
        new = {n: v for n, v in written(records).items() if before.get(n) != v}
    # What turn 40 put: its own messages and ids, no earlier turn's messages.
    blob = b"".join(new.values())
    assert b"question-40-" in blob and b"answer-40-" in blob
    assert not any(f"-{i}-".encode() in blob for i in range(1, 40))
    assert len(new) == 2  # the header and the turn's one log entry
    assert cost[40] < 1.2 * cost[5]  # flat: the bytes do not grow with the conversation
    record = records.get(KEY)
    assert len(record.messages) == 80 and record.messages[-1]["content"].startswith("answer-40-")
    assert record.token_ids == tokens and record.kv_tokens == len(tokens)
    assert record.chunks == [f"c{j}" for j in range(len(tokens) // 64)]
    records.close()
    reopened = LmdbRecordStore(tmp_path / "records")
    assert reopened.get(KEY).messages == record.messages


def test_an_edited_history_keeps_a_prefix_without_rewriting(tmp_path):
    records = LmdbRecordStore(tmp_path / "records")
    version, tokens = 0, []
    for i in range(1, 6):
        version = turn(records, i, version, tokens)
    start = records.bytes_put
    edited = records.append_turn(KEY, version, [{"role": "user", "content": "edited"}], keep=2)
    assert [m["content"][:11] for m in edited.messages] == ["question-1-", "answer-1-aa", "edited"]
    assert records.bytes_put - start < 1000  # one small entry and the header
    records.upsert(KEY, token_ids=[7, 8, 9], chunks=[])  # a truncation: ids cut, then others
    got = records.get(KEY)
    assert got.token_ids == [7, 8, 9] and got.chunks == [] and len(got.messages) == 3


def test_a_full_log_starts_again_from_a_base(tmp_path, monkeypatch):
    monkeypatch.setattr(lmdb_log, "MAX_ENTRIES", 4)
    records = LmdbRecordStore(tmp_path / "records")
    version, tokens = 0, []
    for i in range(1, 8):
        version = turn(records, i, version, tokens)
    logged = [n for n in written(records) if n.startswith(lmdb_log.LOG)]
    assert 1 <= len(logged) <= 4
    record = records.get(KEY)
    assert len(record.messages) == 14 and record.token_ids == tokens


def test_a_whole_record_of_the_older_layout_reads_and_moves_to_a_log(tmp_path):
    records = LmdbRecordStore(tmp_path / "records")
    old = SessionRecord("acme", "s", [{"role": "user", "content": "before"}], token_ids=[1, 2])
    name = records._name(KEY)
    with records.env.begin(write=True) as txn:  # as the version before wrote it: one value
        txn.put(name, old.to_json())
    got = records.get(KEY)
    assert got.messages == old.messages and got.token_ids == [1, 2]
    records.append_turn(KEY, old.version, [{"role": "assistant", "content": "after"}])
    with records.env.begin() as txn:
        header = json.loads(bytes(txn.get(name)))
    assert header["log"] == 1 and "messages" not in header  # its first write made a base
    got = records.get(KEY)
    assert [m["content"] for m in got.messages] == ["before", "after"] and got.token_ids == [1, 2]
    assert records.delete(KEY) and written(records) == {}
