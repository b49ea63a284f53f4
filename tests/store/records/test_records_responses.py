"""A Responses chain stores each response's own items once and links to its parent; reading a
conversation walks the links (records/responses.py)."""

from __future__ import annotations

import json
import time

import pytest

from chatstore.store.records.lmdb import LmdbRecordStore
from chatstore.store.records.redis import RedisRecordStore
from chatstore.store.records.responses import CHAIN_BASE, ResponseRecord


@pytest.fixture(params=["lmdb", "redis"])
def records(request, tmp_path):
    """Record stores whose records live 60 s (the folder's conftest gives them no ttl)."""
    if request.param == "lmdb":
        return LmdbRecordStore(tmp_path / "records", ttl_s=60)
    return RedisRecordStore(request.getfixturevalue("redis_client"), ttl_s=60)


def say(i: int) -> list[dict[str, str]]:
    return [
        {"role": "user", "content": f"question-{i}"},
        {"role": "assistant", "content": f"answer-{i}-" + "x" * 100},
    ]


def chain(records, n: int, created_at: float | None = None) -> list[dict[str, str]]:
    """n responses, each continuing the one before; the conversation through the last."""
    conversation: list[dict[str, str]] = []
    for i in range(n):
        conversation = [*conversation, *say(i)]
        body = {"id": f"r{i}", "previous_response_id": f"r{i - 1}" if i else None}
        record = ResponseRecord("t", f"r{i}", json.dumps(body), "s", list(conversation))
        if created_at is not None:
            record.created_at = created_at
        if i:
            record = records.responses.link(record, f"r{i - 1}")
        records.responses.create(record)
    return conversation


def stored_bytes(records, rid: str) -> int:
    return len(records.responses._get(records.responses._name("t", rid)))


def test_each_response_keeps_its_own_items_and_reads_its_conversation(records):
    conversation = chain(records, 40)
    last = records.responses.get("t", "r39")
    assert records.responses.conversation(last) == conversation
    assert records.responses.conversation(records.responses.get("t", "r7")) == conversation[:16]
    assert all(len(records.responses.get("t", f"r{i}").items) <= 2 for i in range(1, CHAIN_BASE))
    # Linked responses cost their own items; only every CHAIN_BASE-th holds it all.
    assert stored_bytes(records, "r30") < 2 * stored_bytes(records, "r1")
    assert records.responses.get("t", f"r{CHAIN_BASE}").previous_id == ""


def test_a_deleted_response_is_gone_but_read_through(records):
    conversation = chain(records, 5)
    assert records.responses.delete("t", "r2")
    assert records.responses.get("t", "r2") is None and not records.responses.delete("t", "r2")
    assert records.responses.conversation(records.responses.get("t", "r4")) == conversation


def test_lmdb_keeps_expired_ancestors_of_a_live_response(tmp_path):
    records = LmdbRecordStore(tmp_path / "records", ttl_s=60)
    chain(records, 3, created_at=time.time() - 1000)  # r0..r2 expired
    body = json.dumps({"id": "r3", "previous_response_id": "r2"})
    conversation = [*records.responses.conversation(records.responses._read("t", "r2")), *say(3)]
    live = records.responses.link(ResponseRecord("t", "r3", body, "s", conversation), "r2")
    records.responses.create(live)
    records.responses.create(ResponseRecord("t", "alone", "{}", "s", say(9), time.time() - 1000))
    assert records.responses.purge_expired(60) == 1  # "alone" only: r0..r2 are r3's
    assert records.responses.get("t", "r2") is None  # expired for GET all the same
    assert records.responses.conversation(records.responses.get("t", "r3")) == conversation
