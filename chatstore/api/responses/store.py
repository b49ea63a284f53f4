"""Stored responses, kept in the records store's Responses namespace (LMDB, or Redis with
replicas): chatstore/store/records/responses.py.

A response is one `ResponseRecord` of its tenant, named by the response id: the response object
as JSON, the session holding the conversation's KV, and the items it added to the conversation
(input and reply, no instructions: messages, function_call and function_call_output items,
responses/items.py), linked to the response it continues; every 16th of a chain
holds the whole conversation (records/responses.py). Continuing from a response reads its
conversation through the links, whatever happened to its session since (continued by another
response, deleted, expired) and whether or not the responses before it were deleted (a deleted
one stays as a tombstone while others link to it). Records expire with the session TTL, like
sessions; one that a live response links to is kept. Reads and writes block on the records
store: call them from a worker thread.

At rest a response is sealed like any record, under the key of the tenant it belongs to, so
crypto-shredding a tenant makes its stored responses unreadable with its sessions.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from chatstore.api.common.errors import store_error
from chatstore.api.responses.items import Item
from chatstore.store.ports import (
    RecordStoreError,
    ResponseExists,
    ResponseRecord,
    SessionKVAdmin,
)


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex


@dataclass(frozen=True)
class StoredResponse:
    body_json: str  # the response object, as GET returns it (text: a continuation skips it)
    session_id: str  # the session whose record and KV hold this conversation
    items: list[Item]  # the conversation through this response's reply (no instructions)

    @property
    def body(self) -> dict[str, object]:
        body: dict[str, object] = json.loads(self.body_json)  # written by call.py: an object
        return body


class ResponseStore:
    def __init__(self, store: SessionKVAdmin) -> None:
        self.responses = store.responses

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        try:
            record = self.responses.get(tenant, response_id)
        except RecordStoreError as exc:
            raise store_error(exc) from None
        if record is None:
            return None
        try:
            items = self.responses.conversation(record)
        except RecordStoreError as exc:
            raise store_error(exc) from None
        if items is None:  # a link is gone (it cannot be while the response lives)
            return None
        return StoredResponse(record.body_json, record.session_id, items)

    def put(self, tenant: str, response_id: str, response: StoredResponse) -> None:
        """Keep the response durably (the records store's own guarantee); APIError 503/507
        when it cannot be kept."""
        items = [dict(item) for item in response.items]  # messages and function call items
        record = ResponseRecord(
            tenant, response_id, response.body_json, response.session_id, items, time.time()
        )
        previous = json.loads(response.body_json).get("previous_response_id")
        try:
            if previous:
                record = self.responses.link(record, previous)
            self.responses.create(record)
        except RecordStoreError as exc:
            raise store_error(exc) from None
        except ResponseExists:  # a uuid4 collision, or a client-made id: never overwrite
            raise RuntimeError(f"response {response_id} already exists") from None

    def delete(self, tenant: str, response_id: str) -> bool:
        try:
            return self.responses.delete(tenant, response_id)
        except RecordStoreError as exc:
            raise store_error(exc) from None
