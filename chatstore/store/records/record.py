"""A session's durable record (the one `SessionRecord` the store and the API share) and the
errors a record store raises: values only, imported by the contract (base.py), its backends and
the Responses namespace (responses.py) alike."""

from __future__ import annotations

import array
import base64
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from chatstore.store.session_kv import SessionKey


@dataclass(frozen=True)
class ChainRecord:
    """What a session's record keeps of its stored KV chain: the tokens it covers, its chunks'
    digests in order, and the model that computed them."""

    token_ids: list[int]
    chunks: list[str]
    fingerprint: str

    def apply(self, record: SessionRecord) -> None:
        record.token_ids, record.chunks = list(self.token_ids), list(self.chunks)
        record.fingerprint = self.fingerprint


@dataclass
class SessionRecord:
    tenant: str
    session_id: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # the history whose KV is saved
    metadata: dict[str, Any] = field(default_factory=dict)  # the client's, from POST /v1/sessions
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    chunks: list[str] = field(default_factory=list)  # its chunk keys' digests, in order
    # The model the token ids (and chunks) were made for: another model's ids are not reused.
    fingerprint: str = ""
    # Bumped by every write of the messages (not by the store's KV bookkeeping): a turn appends
    # only if the record is still at the version it read (append_turn).
    version: int = 0
    # Retention (retention.py): idle seconds before the session expires (0: the server's
    # session TTL) and its eviction priority (higher stays in the fast tiers longer).
    ttl_s: int = 0
    priority: int = 0
    # The last turn ended on EOS or max_tokens: the store saved the KV of `kv_tokens` tokens
    # and `last_token` (sampled, never fed back) follows them. While `token_ids` still holds
    # exactly that many, the next prompt continues those ids exactly. 0 / None: render afresh.
    kv_tokens: int = 0
    last_token: int | None = None
    # When it expires if left idle (None: never), as the store that read it counts (its TTL
    # is the server's): set on every record a RecordStore returns, never stored.
    expires_at: float | None = None

    @property
    def key(self) -> SessionKey:
        return SessionKey(self.tenant, self.session_id)

    def to_json(self) -> bytes:
        # Token ids as base64 int32: a long history's list costs a JSON round trip per turn
        # otherwise (~7 ms at 7.5K tokens), which made saving grow with the history.
        fields = asdict(self)
        del fields["expires_at"]
        ids = array.array("i", fields.pop("token_ids"))
        fields["token_ids_b64"] = base64.b64encode(ids.tobytes()).decode()
        return json.dumps(fields).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> SessionRecord:
        fields = json.loads(raw)
        packed = fields.pop("token_ids_b64", None)
        if packed is not None:
            ids = array.array("i")
            ids.frombytes(base64.b64decode(packed))
            fields["token_ids"] = ids.tolist()
        fields.pop("expires_at", None)
        known = cls.__dataclass_fields__
        record = cls(**{k: v for k, v in fields.items() if k in known})
        if "kv_tokens" not in fields:
            record._lift_turn_end()
        return record

    def _lift_turn_end(self) -> None:
        """The layout before kv_tokens / last_token were fields: they were keys of the last
        (assistant) message; read them from there."""
        last = self.messages[-1] if self.messages else {}
        if "kv_tokens" in last and "last_token" in last:
            self.kv_tokens, self.last_token = int(last["kv_tokens"]), int(last["last_token"])


@dataclass(eq=False)
class SessionLease:
    """A turn's (or a delete's) lease on its session, shared by replicas (leases.py takes,
    renews and gives it back)."""

    key: SessionKey
    name: str = ""
    token: str = ""
    lost: bool = False  # a renewal found another token (or none): the lease expired
    lock: Any = None  # the redis-py Lock holding it (None: a local lease)


class RecordStoreError(Exception):
    """A record could not be written durably (or read); the caller must not acknowledge."""


class RecordStoreFull(RecordStoreError):
    """No room for the record: the LMDB map (records_map_bytes) or the disk is full."""


class RecordStoreUnavailable(RecordStoreError):
    """The records backend (Redis) is down or did not answer in time."""


class RecordConflict(RecordStoreError):
    """The record changed since the writer read it (another replica wrote the session)."""
