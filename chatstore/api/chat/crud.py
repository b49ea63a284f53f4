"""The sessions as clients manage them: create, change, read, delete, purge; the quota and
limits a new session is checked against (the service's routes reach them through ChatService)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from chatstore.api.chat.limits import check_metadata, check_retention_fields, check_text
from chatstore.api.chat.refusals import session_exists, too_many_sessions
from chatstore.api.chat.reservations import SessionReservations
from chatstore.api.common.chat_template import Message
from chatstore.api.common.errors import bad_param, not_found, store_error
from chatstore.api.common.settings import ServerSettings
from chatstore.store.ports import RecordStoreError, SessionKVAdmin, SessionRecord


def new_session_id() -> str:
    return "sess_" + uuid.uuid4().hex[:24]


def plain(messages: list[dict[str, Any]]) -> list[Message]:
    """Messages as the template and clients see them (role and content only)."""
    return [{"role": m["role"], "content": m["content"]} for m in messages]


class SessionCrud:
    """settings: the service's, replaced whole when its limits change (ChatService.settings)."""

    def __init__(
        self, store: SessionKVAdmin, settings: ServerSettings, reservations: SessionReservations
    ) -> None:
        self.store = store
        self.settings = settings
        self.reservations = reservations

    def create(
        self,
        tenant: str,
        system_prompt: str | None,
        metadata: dict[str, str],
        sid: str | None,
        priority: int = 0,
        ttl_s: int = 0,
    ) -> SessionRecord:
        check_metadata(metadata, self.settings.max_metadata_bytes)
        check_retention_fields({"priority": priority, "ttl_s": ttl_s})
        if sid is not None and self.store.get(tenant, sid) is not None:
            raise session_exists(sid)
        self.check_quota(tenant)
        messages = []
        if system_prompt is not None:
            check_text("system_prompt", system_prompt, self.settings.max_message_chars)
            messages = [{"role": "system", "content": system_prompt}]
        now = time.time()
        record = SessionRecord(tenant, sid or new_session_id(), messages, [], metadata, now, now)
        record.priority, record.ttl_s = priority, ttl_s
        if not self.store.create(record):  # another replica created the id meanwhile
            raise session_exists(record.session_id)
        return record

    def update(self, tenant: str, sid: str, changes: dict[str, Any]) -> SessionRecord:
        """Change the session's priority, ttl_s and/or metadata (404 if it does not exist)."""
        if not changes:
            raise bad_param("body", "nothing to change: give priority, ttl_s or metadata")
        if changes.get("metadata") is not None:
            check_metadata(changes["metadata"], self.settings.max_metadata_bytes)
        elif "metadata" in changes:
            raise bad_param("metadata", "metadata must be an object (send {} to clear it)")
        for name in ("priority", "ttl_s"):
            if name in changes and changes[name] is None:
                raise bad_param(name, f"{name} must be an integer")
        check_retention_fields(changes)
        try:
            record = self.store.update(tenant, sid, **changes)
        except RecordStoreError as exc:
            raise store_error(exc) from None
        if record is None:
            raise not_found(f"session {sid}")
        return record

    def get(self, tenant: str, sid: str) -> SessionRecord:
        record = self.store.get(tenant, sid)
        if record is None:
            raise not_found(f"session {sid}")
        return record

    def delete(self, tenant: str, sid: str) -> None:
        with self.reservations.deleting((tenant, sid)):
            if not self.store.delete(tenant, sid):
                raise not_found(f"session {sid}")

    def purge_expired(self) -> int:
        """Delete the sessions idle past the TTL (records and KV); how many went."""
        return self.store.purge_expired()

    def check_quota(self, tenant: str) -> None:
        """Room for one more session of the tenant (429 otherwise)."""
        if self.store.count_sessions(tenant) >= self.settings.max_sessions_per_tenant:
            raise too_many_sessions(self.settings)
