"""A turn over the API costs one record write (issue 23 item 3): its messages, token ids and
chunk list land in one LMDB transaction, one fsync, not a commit's write and then the API's.

Counted where it lands: LMDB's own transaction id (`env.info()["last_txnid"]` moves by one per
committed write transaction). And what that write holds is the KV store's chain: a server
restarted on the same data reuses the conversation's KV (its cached tokens), which only the
recorded chain makes possible. Real server, real default model.
"""

from __future__ import annotations

import httpx
import pytest

from chatstore.server.launcher import local_server
from chatstore.store.session_kv import SessionKey

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

GREEDY = {"temperature": 0, "max_tokens": 6}
QUESTIONS = ["Tell me about rivers.", "Why do they bend?", "And lakes?", "Thanks. One more?"]


def _server(model, data):
    return local_server(data, model, kv_cache_bytes=48 << 20, dram_bytes=256 << 20)


def _txn(srv) -> int:
    return int(srv.app.state.service.store.records.env.info()["last_txnid"])


def test_a_turn_is_one_record_write_holding_its_chain(default_model, tmp_path):
    replies = []
    with _server(default_model, tmp_path) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        sid = c.post("/v1/sessions", json={"system_prompt": "Answer briefly."})
        assert sid.status_code == 201, sid.text
        sid = sid.json()["id"]
        writes = []
        for q in QUESTIONS:
            before = _txn(srv)
            r = c.post(f"/v1/sessions/{sid}/messages", json={"content": q, **GREEDY})
            assert r.status_code == 200, r.text
            replies.append(r.json()["message"]["content"])
            writes.append(_txn(srv) - before)
        assert writes == [1] * len(QUESTIONS), writes
        store = srv.app.state.service.store
        key = SessionKey("local", sid)
        record = store.records.get(key)
        chain = store.kv.index.get(key)
        assert chain is not None and record is not None
        assert record.chunks == [k.digest for k in chain.chunks]
        assert record.token_ids == list(chain.token_ids)
        assert len(record.messages) == 1 + 2 * len(QUESTIONS)
    # Restarted on the same data: the chain recorded with the last turn is reused.
    with _server(default_model, tmp_path) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        r = c.post(f"/v1/sessions/{sid}/messages", json={"content": "Bye.", **GREEDY})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
