"""Stored responses, kept in the session records store (LMDB, or Redis with replicas).

A response is one record of its tenant's response namespace, named by the response id:

    tenant    "\\x00responses:<tenant>"   (no configured tenant holds a NUL: the environment
                                          cannot carry one, so no tenant can read these as its
                                          sessions)
    messages  the conversation through this response's reply, without instructions
    metadata  {"response": <the response object as JSON>, "session_id": <the session holding
               the conversation's KV>}

Each record holds its whole conversation, so continuing from any response reads one record,
whatever happened to its session since (continued by another response, deleted, expired) and
whether or not the responses before it were deleted. Records expire with the session TTL, like
sessions. Reads and writes block on the records store: call them from a worker thread.

At rest a response is sealed like any record (records.py), under the key of the tenant it
belongs to (sealing/sealer.py `owner_tenant` reads the tenant out of the namespace), so
crypto-shredding a tenant makes its stored responses unreadable with its sessions.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from chatstore.api.chat_template import Message
from chatstore.api.errors import store_error
from chatstore.api.store_port import INTERNAL_TENANT_PREFIX, SessionRecord, SessionStorePort
from chatstore.store.records import RecordStoreError

NAMESPACE = INTERNAL_TENANT_PREFIX + "responses:"


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex


@dataclass(frozen=True)
class StoredResponse:
    body_json: str  # the response object, as GET returns it (text: a continuation skips it)
    session_id: str  # the session whose record and KV hold this conversation
    items: list[Message]  # the conversation through this response's reply (no instructions)

    @property
    def body(self) -> dict[str, Any]:
        return json.loads(self.body_json)


class ResponseStore:
    def __init__(self, store: SessionStorePort) -> None:
        self.store = store

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        try:
            record = self.store.get(NAMESPACE + tenant, response_id)
        except RecordStoreError as exc:
            raise store_error(exc) from None
        if record is None or "response" not in record.metadata:
            return None
        return StoredResponse(
            body_json=record.metadata["response"],
            session_id=record.metadata["session_id"],
            items=[{"role": m["role"], "content": m["content"]} for m in record.messages],
        )

    def put(self, tenant: str, response_id: str, response: StoredResponse) -> None:
        """Keep the response durably (the records store's own guarantee); APIError 503/507
        when it cannot be kept."""
        now = time.time()
        metadata = {"response": response.body_json, "session_id": response.session_id}
        items = list(response.items)
        record = SessionRecord(NAMESPACE + tenant, response_id, items, [], metadata, now, now)
        try:
            created = self.store.create(record)
        except RecordStoreError as exc:
            raise store_error(exc) from None
        if not created:  # a uuid4 collision, or a client-made id: never overwrite
            raise RuntimeError(f"response {response_id} already exists")

    def delete(self, tenant: str, response_id: str) -> bool:
        try:
            return self.store.delete(NAMESPACE + tenant, response_id)
        except RecordStoreError as exc:
            raise store_error(exc) from None
