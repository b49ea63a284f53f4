"""The records' prefix index (which session a client that resends its history continues), the
typed turn end of a record, and stored Responses in their own namespace: LMDB and a real Redis
alike, including records written in the layouts before these."""

from __future__ import annotations

import json
import time

import pytest

from chatstore.store.records.lmdb import INDEX, LmdbRecordStore
from chatstore.store.records.prefix_index import PREFIX_STEP
from chatstore.store.records.record import SessionRecord
from chatstore.store.records.redis import RedisRecordStore
from chatstore.store.records.responses import LEGACY_NAMESPACE, ResponseExists, ResponseRecord
from chatstore.store.session_kv import SessionKey

FP = "model-a"


def save(records, sid: str, ids: list[int], tenant: str = "t", fp: str = FP) -> None:
    """What the store's commit writes after a turn's chunks."""
    records.upsert(SessionKey(tenant, sid), token_ids=ids, chunks=[], fingerprint=fp)


def ids(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


SYSTEM = ids(1000, 40)  # a shared system prompt, shorter than one step


def test_a_saved_history_that_is_a_prefix_wins_over_a_longer_shared_one(records):
    a = [*SYSTEM, *ids(0, 150)]  # 190 tokens
    new = ids(7000, 30)
    save(records, "a", a)
    save(records, "long", [*a, *new[:20], *ids(9000, 100)])  # shares 210 with the prompt
    assert records.match_prefix("t", [*a, *new], FP) == "a"  # a's whole history: it wins


def test_otherwise_the_longest_common_prefix_token_by_token(records):
    base = [*SYSTEM, *ids(0, 150)]
    other = ids(5000, 200)
    save(records, "a", base)
    save(records, "b", [*base[:100], *other])
    save(records, "c", [*base[:101], *ids(6000, 50)])  # one token more than b, same step
    assert records.match_prefix("t", [*base[:150], 1, 2], FP) == "a"  # shares 150
    assert records.match_prefix("t", [*base[:100], *other[:50], 1], FP) == "b"  # 150 vs 101
    assert records.match_prefix("t", [*base[:101], 42], FP) in ("a", "c")  # 101 each
    assert records.match_prefix("t", [*base[:100], 42], FP) in ("a", "b", "c")


def test_short_histories_and_step_boundaries(records):
    short = ids(0, PREFIX_STEP - 1)
    exact = ids(0, 2 * PREFIX_STEP)
    save(records, "short", short)
    save(records, "exact", exact)
    assert records.match_prefix("t", [*short, 99], FP) == "short"
    assert records.match_prefix("t", [*exact, 99], FP) == "exact"  # the longer whole prefix
    assert records.match_prefix("t", ids(0, 10), FP) in ("short", "exact")
    assert records.match_prefix("t", [77, 78], FP) is None


def test_no_match_across_tenants_models_or_after_delete(records):
    history = ids(0, 300)
    save(records, "s", history)
    assert records.match_prefix("t", history, FP) == "s"
    assert records.match_prefix("u", history, FP) is None  # another tenant
    assert records.match_prefix("t", history, "model-b") is None  # another model's ids
    save(records, "s", history, fp="")  # ids no model claims are not indexed
    assert records.match_prefix("t", history, FP) is None
    save(records, "s", history)
    records.delete(SessionKey("t", "s"))
    assert records.match_prefix("t", history, FP) is None


def test_a_turn_moves_the_session_along_and_expiry_hides_it(records):
    first = ids(0, 200)
    save(records, "s", first)
    second = [*first, *ids(500, 100)]
    save(records, "s", second)
    assert records.match_prefix("t", [*second, 1], FP) == "s"
    # Truncated (the oldest history dropped): the old prefix no longer leads to it.
    save(records, "s", ids(800, 90))
    assert records.match_prefix("t", [*second, 1], FP) is None
    assert records.match_prefix("t", [*ids(800, 90), 1], FP) == "s"
    records.patch(SessionKey("t", "s"), ttl_s=1)
    records.patch(SessionKey("t", "s"), updated_at=time.time() - 5)
    assert records.match_prefix("t", [*ids(800, 90), 1], FP) is None


def test_the_index_survives_a_restart_and_is_built_for_older_records(tmp_path):
    path = tmp_path / "records.lmdb"
    store = LmdbRecordStore(path)
    save(store, "s", ids(0, 300))
    store.close()
    store = LmdbRecordStore(path)
    assert store.match_prefix("t", ids(0, 310), FP) == "s"
    # A store written before the index: no entries, no marker. Opening it indexes it.
    with store.env.begin(write=True) as txn:
        names = [bytes(k) for k, _ in txn.cursor() if bytes(k)[:2] in (INDEX, b"m:")]
        for name in names:
            txn.delete(name)
    assert names and store.match_prefix("t", ids(0, 310), FP) is None
    store.close()
    store = LmdbRecordStore(path)
    assert store.match_prefix("t", ids(0, 310), FP) == "s"
    store.close()


def test_redis_replicas_share_the_index_and_index_older_records(redis_url, redis_client):
    one, two = RedisRecordStore(redis_url), RedisRecordStore(redis_url)
    save(one, "s", ids(0, 300))
    assert two.match_prefix("t", ids(0, 320), FP) == "s"  # made on the other replica
    redis_client.delete(one._index_name("t"))  # as written before the index
    assert two.match_prefix("t", ids(0, 320), FP) == "s"  # the first lookup indexes them
    one.close()
    two.close()


def test_turn_end_is_typed_and_the_old_layout_still_loads(records):
    key = SessionKey("t", "s")
    saved = records.append_turn(key, 0, [{"role": "user", "content": "hi"}], kv_tokens=7)
    assert (saved.kv_tokens, saved.last_token) == (7, None)
    stored = json.loads(records.get(key).to_json())
    assert stored["kv_tokens"] == 7 and "expires_at" not in stored
    reply = {"role": "assistant", "content": "yo", "kv_tokens": 12, "last_token": 2}
    old = {k: v for k, v in stored.items() if k not in ("kv_tokens", "last_token")}
    old["messages"] = [*old["messages"], reply]
    record = SessionRecord.from_json(json.dumps(old))
    assert (record.kv_tokens, record.last_token) == (12, 2)


def response(tenant: str, rid: str) -> ResponseRecord:
    items = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    return ResponseRecord(tenant, rid, json.dumps({"id": rid}), "sess_1", items)


def test_responses_have_their_own_namespace(records):
    records.responses.create(response("t", "resp_1"))
    with pytest.raises(ResponseExists):
        records.responses.create(response("t", "resp_1"))
    got = records.responses.get("t", "resp_1")
    assert (got.body_json, got.session_id, got.items) == (
        '{"id": "resp_1"}',
        "sess_1",
        response("t", "resp_1").items,
    )
    assert records.responses.get("u", "resp_1") is None  # another tenant's
    assert records.list_sessions() == []  # no session, under any tenant
    assert records.responses.delete("t", "resp_1")
    assert records.responses.get("t", "resp_1") is None
    records.responses.create(response("t", "resp_2"))
    assert records.responses.delete_tenant("t") == 2  # resp_2 and resp_1's tombstone


def test_a_response_stored_the_old_way_loads_and_moves(records):
    old = response("t", "resp_old")
    metadata = {"response": old.body_json, "session_id": old.session_id}
    records.create(SessionRecord(LEGACY_NAMESPACE + "t", "resp_old", old.items, [], metadata))
    got = records.responses.get("t", "resp_old")
    assert got is not None and (got.body_json, got.items) == (old.body_json, old.items)
    assert records.get(SessionKey(LEGACY_NAMESPACE + "t", "resp_old")) is None  # moved
    assert records.responses.get("t", "resp_old").session_id == "sess_1"


def test_responses_expire_with_the_session_ttl(tmp_path):
    store = LmdbRecordStore(tmp_path / "records.lmdb", ttl_s=60)
    stale = response("t", "resp_1")
    stale.created_at = time.time() - 120
    store.responses.create(stale)
    store.responses.create(response("t", "resp_2"))
    assert store.responses.get("t", "resp_1") is None
    store.purge_expired()
    assert store.responses._get(store.responses._name("t", "resp_1")) is None
    assert store.responses.get("t", "resp_2") is not None
    store.close()
